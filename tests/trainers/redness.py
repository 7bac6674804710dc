"""A differentiable test reward for the toy world: how much redder than green and blue an image is, on average."""

import torch

from flowrl.types import RewardOutput


class RednessReward:
    modalities = ("image",)
    differentiable = True

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput((images[:, 0] - images[:, 1:].mean(1)).mean((1, 2)))  # [N]
