"""toy_attributes: the Shapes world's "GenEval" — P(count, colour and shape of the prompt) by the attribute judge.

Score = P(count) * P(colour) * P(shape) for the prompt's attributes under the judge's three softmax heads
(the heads are trained independently, so the product is the judge's joint). Parts: the three factors.
Range [0, 1]; differentiable (a plain CNN, the graph is kept). Prompts must be in the Shapes grammar.

`other_penalty=λ` (default 0) subtracts λ * P(impossible), P(impossible) = 1 - prod_heads (1 - P(head = other)), the
judge's probability that the scene is one the world never draws (part "impossible"): a wrong but possible count then
scores above an impossible one, where both score ~0 without it. Range [-λ, 1].

Each head of the shipped judge also has an "other" class (flowrl/toy/judges.py) trained on scenes the world never
draws, so its softmax spreads over 4 / 5 / 4 classes: no shape, four or five shapes, two colours or two shapes in one
scene score near 0 for every prompt (held-out mean of the best prompt's score 0.0017 raw, 0.0022 softened; the first,
count-blind judge, kept as tests/toy/fixtures/toy_attributes_countblind.safetensors and loadable with `checkpoint=`,
gave them 0.97). It was also trained on scenes with one shape faded and shrunk (`--faint-fraction 0.25`), so three
clean shapes beside a faint fourth score 0.003 for "three ..." (docs/toy.md#judges).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.types import RewardOutput


@REWARDS.register("toy_attributes")
class ToyAttributesReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ()

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        checkpoint: str | None = None,
        other_penalty: float = 0.0,
    ):
        from flowrl.toy.judges import load_judge

        self.device, self.dtype = torch.device(device), dtype
        self.judge = load_judge("attributes", checkpoint, device=self.device, dtype=dtype)
        self.other_penalty = float(other_penalty)
        if self.other_penalty < 0:
            raise ValueError(f"toy_attributes: other_penalty={other_penalty} must be >= 0 (0 turns the penalty off)")
        if self.other_penalty and not self.judge.other_class:
            raise ValueError(
                "toy_attributes: other_penalty needs a judge with 'other' classes; this checkpoint is count-blind "
                "(leave other_penalty at 0 or use the shipped judge)"
            )

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        from flowrl.toy.judges import judge_input
        from flowrl.toy.world import parse_prompt

        images = judge_input(images.to(self.device), self.dtype)  # [N, 3, 32, 32]
        if len(prompts) != images.shape[0]:
            raise ValueError(
                f"toy_attributes: {images.shape[0]} images but {len(prompts)} prompts; give one prompt per image"
            )
        labels = torch.tensor([parse_prompt(p).labels for p in prompts], device=self.device)  # [N, 3]
        logits = self.judge(images)
        parts = {
            name: logits[name].float().softmax(dim=1).gather(1, labels[:, i : i + 1]).squeeze(1)  # [N]
            for i, name in enumerate(("count", "colour", "shape"))
        }
        scores = parts["count"] * parts["colour"] * parts["shape"]  # [N]
        if self.other_penalty:
            from flowrl.toy.judges import OTHER_CLASS

            possible = torch.ones_like(scores)
            for name, index in OTHER_CLASS.items():
                possible = possible * (1 - logits[name].float().softmax(dim=1)[:, index])
            parts["impossible"] = 1 - possible
            scores = scores - self.other_penalty * parts["impossible"]
        return RewardOutput(scores=scores, parts=parts)
