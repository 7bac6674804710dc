"""Shared CLIP pieces for the open_clip rewards (clipscore, hpsv2, aesthetic, temporal_consistency):
weight resolution through the Hugging Face cache (downloaded unless HF_HUB_OFFLINE) and a differentiable image
preprocessing that mirrors open_clip's transform.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_TAG = "openai"  # pretrained tag used when an architecture name comes without one


@dataclass
class ImagePreprocess:
    """Resize the shortest side to `size` (bicubic, antialiased), center-crop `size` x `size`, normalize.

    Pure torch, so the graph from images to scores is kept (PIL would cut it).
    """

    size: int
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        dtype = images.dtype  # resample in float32 at least: antialiased bicubic has no half-precision CPU kernel
        images = images.to(torch.promote_types(dtype, torch.float32))
        h, w = images.shape[-2:]
        if (h, w) != (self.size, self.size):
            scale = self.size / min(h, w)
            new_h, new_w = max(self.size, round(h * scale)), max(self.size, round(w * scale))
            images = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
            top, left = (new_h - self.size) // 2, (new_w - self.size) // 2
            images = images[..., top : top + self.size, left : left + self.size]
        mean = torch.tensor(self.mean, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
        return ((images - mean) / std).to(dtype)  # [N, 3, size, size]


def _open_clip_file(model: str, tag: str) -> tuple[str, dict[str, Any]]:
    """Path of a pretrained tag's weights: the Hugging Face cache, else a download unless HF_HUB_OFFLINE."""
    import open_clip

    from flowrl.hub import HubUnavailableError, download_file

    cfg = open_clip.get_pretrained_cfg(model, tag)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model)
        raise ValueError(
            f"pretrained={tag!r} is not an open_clip tag of {model!r}; use one of {tags} or a weights file path"
        )
    repo = cfg.get("hf_hub", "").rstrip("/")
    if not repo:
        raise FileNotFoundError(
            f"open_clip tag {model}/{tag} has no Hugging Face repository; pass pretrained=/path/to/weights"
        )
    failures = []
    for filename in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):  # the repo holds one of the two
        try:
            return download_file(repo, filename, f"open_clip weights {model}/{tag}:"), cfg
        except HubUnavailableError as err:
            failures.append(err)
    raise next((err for err in failures if err.reason != "no_file"), failures[0])


def load_open_clip(model: str, pretrained: str | None, device: Any, dtype: torch.dtype, checkpoint: str | None = None):
    """Build an open_clip model in eval mode, frozen. Returns (model, tokenizer, ImagePreprocess).

    model: an open_clip architecture name ("ViT-L-14") or a local folder in open_clip's hub layout
      (open_clip_config.json + open_clip_model.safetensors). pretrained: an open_clip tag (looked up in the
      HF cache, downloaded unless HF_HUB_OFFLINE; None = "openai" for an architecture name) or a weights file; must be
      None with a folder. checkpoint: a further state dict loaded on top (e.g. HPS v2 weights; a {"state_dict": ...}
      wrapper is accepted).
    """
    import open_clip

    kwargs: dict[str, Any] = {}
    if os.path.isdir(model):
        name = f"local-dir:{model}"
        if pretrained is not None:
            raise ValueError(
                f"pretrained={pretrained!r} given with model folder {model!r}; the folder holds the weights, "
                "drop pretrained"
            )
    else:
        name = model
        if open_clip.get_model_config(model) is None:
            raise ValueError(
                f"model={model!r} is neither an open_clip architecture nor a local folder; e.g. 'ViT-L-14' or "
                "/path/to/open_clip_folder"
            )
        if pretrained is None and checkpoint is None:
            pretrained = DEFAULT_TAG
        if pretrained is not None and not os.path.isfile(pretrained):
            if os.sep in pretrained or pretrained.endswith((".bin", ".pt", ".pth", ".safetensors")):
                raise FileNotFoundError(
                    f"pretrained weights file {pretrained!r} does not exist; pass an existing file or an open_clip tag"
                )
            path, cfg = _open_clip_file(model, pretrained)
            kwargs["force_quick_gelu"] = bool(cfg.get("quick_gelu", False))
            kwargs["force_preprocess_cfg"] = {k: cfg[k] for k in ("mean", "std") if k in cfg}
            pretrained = path
    clip = open_clip.create_model(name, pretrained=pretrained, device="cpu", **kwargs)
    if checkpoint is not None:
        clip.load_state_dict(read_state_dict(checkpoint, "checkpoint"))
    clip = clip.to(device=device, dtype=dtype).eval().requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(name)
    cfg = clip.visual.preprocess_cfg
    size = cfg["size"][0] if isinstance(cfg["size"], (tuple, list)) else cfg["size"]
    preprocess = ImagePreprocess(int(size), tuple(cfg["mean"]), tuple(cfg["std"]))
    return clip, tokenizer, preprocess


def read_state_dict(path: str, field: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{field} file {path!r} does not exist; pass the path of the downloaded weights")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


def normalized(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)
