"""A second differentiable test reward for the toy world: tanh(10 · redness), redness as in tests/trainers/redness.py.

A strictly increasing function of redness, so it ranks any group's samples as redness does, on another scale: the
composition matrix's two rewards (tests/trainers/composition.py) then never pull a group apart in opposite directions.
"""

import torch
from redness import RednessReward

from flowrl.types import RewardOutput


class SteepRednessReward(RednessReward):
    def __call__(self, images, prompts, metadata):
        return RewardOutput(torch.tanh(10 * super().__call__(images, prompts, metadata).scores))  # [N]
