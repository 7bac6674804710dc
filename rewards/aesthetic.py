"""LAION aesthetic predictor: a linear (v1) or MLP (v2, "improved aesthetic predictor") head on L2-normalized
CLIP ViT-L/14 image embeddings; scores are on the 1-10 rating scale of the LAION/AVA data.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import load_open_clip, normalized, read_state_dict

WEIGHTS_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor (sac+logos+ava1-l14-linearMSE.pth)"


def build_aesthetic_head(state: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """The head as the checkpoint lays it out: `weight`/`bias` (one Linear) or `layers.<i>.weight` (Linears
    interleaved with dropouts and no activations, exactly like the improved predictor's MLP)."""
    if set(state) == {"weight", "bias"}:
        head = torch.nn.Sequential(torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0]))
        head[0].load_state_dict(state)
        return head
    indices = sorted({int(m.group(1)) for key in state if (m := re.fullmatch(r"layers\.(\d+)\.weight", key))})
    if not indices:
        raise ValueError(
            f"aesthetic: checkpoint keys {sorted(state)[:4]} are neither a linear nor a `layers.<i>` MLP head; "
            "pass the LAION predictor weights"
        )
    modules: list[torch.nn.Module] = [
        torch.nn.Identity() for _ in range(indices[-1] + 1)
    ]  # dropouts stay Identity in eval
    for i in indices:
        out_dim, in_dim = state[f"layers.{i}.weight"].shape
        modules[i] = torch.nn.Linear(in_dim, out_dim)
    head = torch.nn.Sequential(*modules)
    head.load_state_dict({key.removeprefix("layers."): value for key, value in state.items()})
    return head


@REWARDS.register("aesthetic")
class AestheticReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ("open-clip-torch",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        checkpoint: str | None = None,
        model_name: str = "ViT-L-14",
        pretrained: str | None = None,
    ):
        if checkpoint is None or not os.path.isfile(checkpoint):
            given = "is not set" if checkpoint is None else f"{checkpoint!r} does not exist"
            raise FileNotFoundError(
                f"aesthetic: checkpoint {given}; download it from {WEIGHTS_URL} and pass checkpoint="
            )
        self.device, self.dtype = torch.device(device), dtype
        self.model, _, self.preprocess = load_open_clip(model_name, pretrained, self.device, dtype)
        self.head = (
            build_aesthetic_head(read_state_dict(checkpoint, "checkpoint"))
            .to(self.device, dtype)
            .eval()
            .requires_grad_(False)
        )

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        embeddings = normalized(self.model.encode_image(self.preprocess(images.to(self.device, self.dtype))))  # [N, D]
        return RewardOutput(scores=self.head(embeddings).squeeze(-1).float())
