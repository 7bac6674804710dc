"""Artifact reward (docs/rewards.md#artifact-reward): a safeguard against reward hacking, reward = 1 - P(artifact).

Two backends:
  classifier  a small CNN trained by `scripts/train_artifact_reward.py --data DIR` on `clean/` vs `artifact/`
              images, saved as one safetensors file whose metadata holds its config; differentiable.
  vlm         a transformers vision-language judge (local folder or hub id) answering a yes/no artifact question;
              P(artifact) = sigmoid(logp_yes - logp_no) at the first answer token (see _artifact_judge.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

FORMAT = "flowrl-artifact-classifier"


class ArtifactCNN(torch.nn.Module):
    """Stride-2 conv blocks (conv 3x3, GroupNorm, SiLU), global average pool, one logit for "artifact"."""

    def __init__(self, image_size: int = 64, channels: tuple[int, ...] = (16, 32, 64)):
        super().__init__()
        self.config = {"image_size": int(image_size), "channels": [int(c) for c in channels]}
        blocks: list[torch.nn.Module] = []
        c_in = 3
        for c_out in channels:
            blocks += [
                torch.nn.Conv2d(c_in, c_out, 3, stride=2, padding=1),
                torch.nn.GroupNorm(min(8, c_out), c_out),
                torch.nn.SiLU(),
            ]
            c_in = c_out
        self.features = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(c_in, 1)

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] in [0, 1] -> [N, 3, S, S] in [-1, 1]; a differentiable resize (the whole frame, no crop)."""
        size, dtype = self.config["image_size"], images.dtype
        if images.shape[-2:] != (size, size):  # antialiased resampling has no half-precision CPU kernel: use float32
            images = F.interpolate(
                images.to(torch.promote_types(dtype, torch.float32)),
                size=(size, size),
                mode="bilinear",
                align_corners=False,
                antialias=True,
            ).to(dtype)
        return images * 2 - 1

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.inputs(images)).mean(dim=(2, 3))).squeeze(-1)  # [N] logits


def save_artifact_classifier(model: ArtifactCNN, path: str, extra: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    metadata = {"format": FORMAT, "config": json.dumps(model.config), "training": json.dumps(extra or {})}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, metadata=metadata)


def load_artifact_classifier(path: str) -> ArtifactCNN:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"artifact: checkpoint {path!r} does not exist; train one with "
            f"`python scripts/train_artifact_reward.py --data DIR --out {path}`"
        )
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(
            f"artifact: {path!r} is not a {FORMAT} file (metadata format={metadata.get('format')!r}); "
            "use one written by scripts/train_artifact_reward.py"
        )
    model = ArtifactCNN(**json.loads(metadata["config"]))
    model.load_state_dict(load_file(path))
    return model


@REWARDS.register("artifact")
class ArtifactReward:
    modalities = ("image",)
    differentiable = True  # the classifier backend; the vlm backend sets self.differentiable = False
    extra_requires: tuple[str, ...] = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str = "classifier",
        checkpoint: str | None = None,
        model_name: str | None = None,
        question: str | None = None,
    ):
        self.device, self.dtype, self.backend = torch.device(device), dtype, backend
        if backend == "classifier":
            if checkpoint is None:
                raise FileNotFoundError(
                    "artifact: checkpoint is not set; train one with "
                    "`python scripts/train_artifact_reward.py --data DIR --out artifact.safetensors` and pass "
                    "checkpoint="
                )
            self.model = load_artifact_classifier(checkpoint).to(self.device, dtype).eval().requires_grad_(False)
        elif backend == "vlm":
            from ._artifact_judge import VLMArtifactJudge

            self.judge = VLMArtifactJudge(model_name, self.device, dtype, question=question)
            self.differentiable = False
        else:
            raise ValueError(f"artifact: backend={backend!r} is unknown; use 'classifier' or 'vlm'")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        if self.backend == "classifier":
            logits = self.model(images.to(self.device, self.dtype))  # [N]
        else:
            logits = self.judge.yes_minus_no(images)  # [N] logp_yes - logp_no
        p_artifact = torch.sigmoid(logits)
        return RewardOutput(scores=(1 - p_artifact).float(), parts={"p_artifact": p_artifact.detach().float()})
