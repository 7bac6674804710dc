"""toy_artifact: 1 - P(artifact) by the Shapes world's artifact judge (clean renders vs noise, blocking,
stripes, saturation). Range [0, 1]; differentiable (a plain CNN, the graph is kept); prompts are ignored.

`output="log_odds"` scores log(P(clean) / P(artifact)) = minus the judge's logit instead: unbounded, so a clean
image can still gain where the probability has saturated (the toy model's samples: 1 - P = 0.9999, log-odds ~9).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.types import RewardOutput

OUTPUTS = ("clean", "log_odds")  # 1 - P(artifact), or log(P(clean) / P(artifact))


@REWARDS.register("toy_artifact")
class ToyArtifactReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ()

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        checkpoint: str | None = None,
        output: str = "clean",
    ):
        from flowrl.toy.judges import load_judge

        if output not in OUTPUTS:
            raise ValueError(f"toy_artifact: output={output!r} must be one of {', '.join(OUTPUTS)}")
        self.output = output
        self.device, self.dtype = torch.device(device), dtype
        self.judge = load_judge("artifact", checkpoint, device=self.device, dtype=dtype)

    def __call__(
        self, images: torch.Tensor, prompts: list[str] | None = None, metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        from flowrl.toy.judges import judge_input

        logits = self.judge(judge_input(images.to(self.device), self.dtype)).float()  # [N]
        return RewardOutput(scores=-logits if self.output == "log_odds" else 1.0 - torch.sigmoid(logits))
