"""Autocast of the denoiser, applied inside every adapter's `velocity` (one place for rollout and training).

The rollout's behaviour log-probs and the trainer's recomputed ones must come from the same numerics, so the
precision is a property of the model, not of the caller: `model.autocast_dtype = torch.bfloat16` makes
every velocity call run under `torch.autocast(device, bfloat16)`; None (the default) runs the weights' dtype.
"""

from __future__ import annotations

import contextlib

import torch

MIXED_PRECISION = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastMixin:
    device: torch.device
    autocast_dtype: torch.dtype | None = None

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """'fp32' (no autocast), 'bf16' or 'fp16'."""
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"model.mixed_precision={mixed_precision!r} must be fp32, bf16 or fp16")
        self.autocast_dtype = MIXED_PRECISION[mixed_precision]

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype)
