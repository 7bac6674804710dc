"""flowrl: reinforcement learning for flow-matching image and video generators."""

__version__ = "0.1.0"
