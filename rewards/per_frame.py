"""Video reward from any image reward: score every k-th frame, reduce over frames by mean or min."""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput


@REWARDS.register("per_frame")
class PerFrameReward:
    modalities = ("video",)
    differentiable = True  # as differentiable as the wrapped reward; see `self.differentiable`
    extra_requires: tuple[str, ...] = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        reward: str | None = None,
        reward_config: dict[str, Any] | None = None,
        reduce: str = "mean",
        every_k_frames: int = 1,
    ):
        if not reward:
            raise ValueError("per_frame: reward is not set; name the image reward to wrap, e.g. reward=clipscore")
        if reduce not in ("mean", "min"):
            raise ValueError(f"per_frame: reduce={reduce!r} is unknown; use 'mean' or 'min'")
        if int(every_k_frames) < 1:
            raise ValueError(f"per_frame: every_k_frames={every_k_frames} must be >= 1")
        self.inner = REWARDS.build(reward, device=device, dtype=dtype, **(reward_config or {}))
        if "image" not in self.inner.modalities:
            raise ValueError(
                f"per_frame: reward {reward!r} scores {self.inner.modalities}, not images; wrap an image reward"
            )
        self.differentiable = bool(self.inner.differentiable)
        self.reduce, self.every_k_frames = reduce, int(every_k_frames)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata, modality="video")
        frames = images[:, :: self.every_k_frames]  # [N, F', 3, H, W]
        n, f = frames.shape[:2]
        flat_prompts = [p for p in prompts for _ in range(f)]
        flat_metadata = [dict(m, frame=j) for m in metadata for j in range(f)]
        per_frame = self.inner(frames.flatten(0, 1), flat_prompts, flat_metadata).scores.view(n, f)  # [N, F']
        scores = per_frame.mean(1) if self.reduce == "mean" else per_frame.min(1).values  # NaN propagates
        return RewardOutput(scores=scores.float(), parts={"frame_min": per_frame.detach().min(1).values.float()})
