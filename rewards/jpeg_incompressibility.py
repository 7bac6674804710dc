"""JPEG incompressibility (DDPO): the JPEG-encoded size in kB at quality 95; busier images score higher."""

from __future__ import annotations

from flowrl.registry import REWARDS

from .jpeg_compressibility import JpegCompressibilityReward


@REWARDS.register("jpeg_incompressibility")
class JpegIncompressibilityReward(JpegCompressibilityReward):
    sign = 1.0
