"""Conditioning images: how a sample's source image (its `metadata["image"]`) reaches the model.

Samplers encode a batch with `encode_prompts(model, prompts, metadata, negative_prompt, guidance, size)`. A text-only
model (no `conditioning` attribute, or None) gets `model.encode(prompts, negative_prompt, guidance)` and refuses
an image; an edit or image-to-video model (`conditioning = "image"`) needs one image per sample and gets
`model.encode(..., images=paths, size=(height, width, num_frames))`.

Size policy (docs/models.md#conditioning-images): a source image is resized to the sample's height x width, as
`WanImageToVideoPipeline` does and as the Qwen-Image-Edit pipelines do when the sample has the source's size (their
default); an image whose aspect ratio is more than 5% away from the sample's would be stretched, and is refused.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from flowrl.types import Cond

ASPECT_TOLERANCE = 0.05  # |log(source aspect / sample aspect)| above this would stretch the source visibly


def conditioning_kind(model) -> str | None:
    """'image' for models conditioned on a source image (edit, image-to-video); None for text-only ones."""
    return getattr(model, "conditioning", None)


def source_paths(metadata: list[dict[str, Any]] | None, num: int) -> list[str | None]:
    """Each sample's `metadata["image"]` (None where absent)."""
    if not metadata:
        return [None] * num
    return [m.get("image") for m in metadata]


def encode_prompts(
    model,
    prompts: list[str],
    metadata: list[dict[str, Any]] | None,
    negative_prompt: str,
    guidance_scale: float,
    size: tuple[int, int, int | None],
) -> Cond:
    """The conditioning of a batch: prompts (and source images, for the models that take one)."""
    images = source_paths(metadata, len(prompts))
    if conditioning_kind(model) is None:
        given = next((p for p in images if p is not None), None)
        if given is not None:
            raise ValueError(
                f"metadata image={given!r} given to the text-only {model.family} model; drop the prompts' images or "
                "use an edit / image-to-video model (QwenImageEditPipeline, QwenImageEditPlusPipeline, "
                "WanImageToVideoPipeline)"
            )
        return model.encode(prompts, negative_prompt, guidance_scale)
    missing = [i for i, p in enumerate(images) if p is None]
    if missing:
        raise ValueError(
            f"prompt {prompts[missing[0]]!r} has no source image, which the {model.family} model needs; give every "
            'prompt one: a JSONL prompts file with {"prompt": ..., "image": path} lines, or '
            "`flowrl sample --image PATH`"
        )
    return model.encode(prompts, negative_prompt, guidance_scale, images=images, size=size)


@functools.lru_cache(maxsize=64)
def _open(path: str):
    from PIL import Image

    from flowrl.media import load_image

    load_image(path)  # the one-line errors for a missing or unreadable file
    with Image.open(path) as image:
        return image.convert("RGB")


def source_image(path: str, height: int, width: int):
    """The source image at `path` as an RGB PIL image (cached by path), checked against the sample's aspect ratio."""
    image = _open(path)
    check_aspect(path, image.width, image.height, height, width)
    return image


def check_aspect(path: str, image_w: int, image_h: int, height: int, width: int) -> None:
    if abs(math.log((image_w / image_h) / (width / height))) > ASPECT_TOLERANCE:
        raise ValueError(
            f"source image {path!r} is {image_w}x{image_h} (aspect {image_w / image_h:.3f}) but samples are "
            f"{width}x{height} (aspect {width / height:.3f}): it is resized to the sample's size and would be "
            "stretched; crop it to the sample's aspect ratio or set sampler.height / sampler.width to its own"
        )
