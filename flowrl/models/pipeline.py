"""The part every diffusers-backed adapter shares: loading, the prompt cache, LoRA, the reference switch.

A family file (sd3.py, flux.py, flux2.py, sana.py, wan.py, wan_i2v.py, qwen_image.py, qwen_image_edit.py,
z_image.py, ltx2.py) subclasses `PipelineFlowModel` and writes only what its pipeline does differently: how prompts
are encoded, how latents are laid out, how the transformer is called and how latents decode. Time grids come from
`flowrl.schedules`, timesteps from `flowrl.sde`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from flowrl import work
from flowrl.models.lora import LoRAMixin
from flowrl.models.placement import on_device
from flowrl.models.precision import AutocastMixin
from flowrl.models.prompt_cache import PromptCache
from flowrl.types import Cond, concat_cond


class PipelineFlowModel(LoRAMixin, AutocastMixin):
    """FlowModel over a loaded diffusers pipeline (see flowrl.types.FlowModel for the contract)."""

    family: str = ""
    is_video: bool = False
    default_guidance_scale: float = 1.0
    max_sequence_length: int = 512  # text tokens per prompt; each family states its pipeline's default
    conditioning: str | None = None  # "image": edit / image-to-video families take a source image per sample
    offloaded: tuple[torch.nn.Module, ...] = ()  # text encoders kept on the CPU (flowrl.models.placement)

    def __init__(self, pipe: Any, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = pipe.transformer
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()
                component.requires_grad_(False)
        self._cache = PromptCache()  # (prompt, negative[, image, size]) -> rows [1], LRU by bytes
        for name in ("transformer", "transformer_2"):  # the work meter counts every forward (flowrl.work)
            work.meter_transformer(getattr(pipe, name, None))

    # ----------------------------------------------------------------------------------------- prompts
    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        """Encode prompts (and the negative prompt when not None) with the pipeline; rows [N]."""
        raise NotImplementedError

    def _encode_source(self, prompt: str, negative_prompt: str | None, image: str, size: tuple) -> Cond:
        """One prompt with its source image (edit and image-to-video families); rows [1]."""
        raise NotImplementedError

    @torch.no_grad()
    def encode(
        self,
        prompts: list[str],
        negative_prompt: str = "",
        guidance_scale: float = 1.0,
        images: list[str] | None = None,
        size: tuple[int, int, int | None] | None = None,
    ) -> Cond:
        """Prompts [N] (and, for `conditioning = "image"` families, each one's source image path and the sample
        size (height, width, num_frames) the images are prepared for: flowrl.models.conditioning)."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        negative = negative_prompt if self.uses_cfg(guidance_scale) else None
        if self.conditioning is None:
            if images is not None and any(i is not None for i in images):
                raise ValueError(f"images={images[:1]!r}...: the {self.family} model is text-only; pass no images")
            keys = [(p, negative) for p in prompts]
        else:
            if images is None or size is None or len(images) != len(prompts) or any(i is None for i in images):
                raise ValueError(f"the {self.family} model needs one source image per prompt and the sample size")
            keys = [(p, negative, image, tuple(size)) for p, image in zip(prompts, images)]
        # one prompt per text-encoder call: an embedding must not depend on which prompts shared its batch
        # (batch-size-dependent numerics would make a resumed run drift from an uninterrupted one)
        rows = {k: self._cache.get(k, self.device) for k in dict.fromkeys(keys) if k in self._cache}
        missing = [k for k in dict.fromkeys(keys) if k not in rows]
        with on_device(self.offloaded, self.device) if missing else contextlib.nullcontext():
            for key in missing:
                rows[key] = self._encode_batch([key[0]], negative) if len(key) == 2 else self._encode_source(*key)
                work.encoded(1 + (negative is not None), (1 + (negative is not None)) * self.max_sequence_length)
                self._cache.put(key, rows[key])
        return concat_cond([rows[k] for k in keys])

    def set_prompt_cache(self, max_bytes: int, device: str = "model") -> None:
        """Bound the prompt cache to `max_bytes` (least recently used prompts go first) and keep it on the model's
        device or the CPU (`device="cpu"`: each batch's rows are copied to the model's device); clears it."""
        self._cache = PromptCache(max_bytes, device)

    def clear_prompt_cache(self) -> None:
        """Forget every encoded prompt: the next `encode` runs the text encoders again."""
        self._cache.clear()

    def set_max_sequence_length(self, length: int) -> None:
        """Text tokens per prompt (the pipelines' `max_sequence_length`); clears the prompt cache."""
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"model.max_sequence_length={length!r} must be a positive whole number (e.g. 128)")
        self.max_sequence_length = length
        self._cache.clear()

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether `guidance_scale` means true classifier-free guidance (two branches) for this family."""
        return guidance_scale > 1.0

    # ----------------------------------------------------------------------------------------- latents
    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        factor = self.size_factor()
        for name, value in (("height", height), ("width", width)):
            if value <= 0 or value % factor:
                raise ValueError(f"{name}={value} is not a positive multiple of {factor}, which {self.family} needs")

    # The plain image layout [C, H/f, W/f] of SD3 and SANA; FLUX (packed tokens) and Wan (video) override these.
    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor * self.transformer.config.patch_size

    @property
    def native_size(self) -> tuple[int, int, int | None]:
        """(height, width, num_frames) the pipeline generates when none are given."""
        side = int(getattr(self.pipe, "default_sample_size", 64)) * int(getattr(self.pipe, "vae_scale_factor", 8))
        return side, side, None

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // f, width // f)

    def prepare_latents(
        self, num: int, height: int, width: int, generator=None, num_frames: int | None = None
    ) -> torch.Tensor:
        """Initial noise drawn like the pipeline draws it (in the transformer dtype), returned as float32."""
        from diffusers.utils.torch_utils import randn_tensor

        self.check_size(height, width, num_frames)
        shape = self._noise_shape(num, height, width, num_frames)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.noise_dtype)
        return self._pack(noise).float()

    @property
    def noise_dtype(self) -> torch.dtype:
        """The dtype the pipeline draws its initial noise in (the transformer's, unless a family says otherwise)."""
        return self.transformer.dtype

    def _noise_shape(self, num: int, height: int, width: int, num_frames: int | None) -> tuple[int, ...]:
        return (num, *self.latent_shape(height, width, num_frames))

    def _pack(self, noise: torch.Tensor) -> torch.Tensor:
        return noise

    def image_seq_len(self, height: int, width: int, num_frames: int | None = None) -> int:
        _, h, w = self.latent_shape(height, width)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

    # ----------------------------------------------------------------------------------------- time
    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        from flowrl import schedules

        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1")
        config = self.pipe.scheduler.config
        mu = self.shift_mu(num_steps, height, width, num_frames) if config.get("use_dynamic_shifting", False) else None
        return schedules.scheduler_sigmas(config, num_steps, sigmas=self.custom_sigmas(num_steps), mu=mu)

    def shift_mu(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> float:
        """The dynamic-shift μ the pipeline hands its scheduler (FLUX.1's, linear in the token count, by default)."""
        from flowrl import schedules

        config = self.pipe.scheduler.config
        return schedules.calculate_shift(
            self.image_seq_len(height, width, num_frames),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        """The explicit sigma list the pipeline hands its scheduler (FLUX does), or None."""
        return None

    # ----------------------------------------------------------------------------------------- network
    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor | float, cond: Cond, guidance_scale: float
    ) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(latents.shape[0])
        with self.autocast():
            return self._velocity(latents.to(self.transformer.dtype), sigma, cond, guidance_scale).float()

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] (videos [N, 3, F, H, W]) in [0, 1]; counted by the work meter (flowrl.work)."""
        return work.decoded(self._decode(latents))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()

    def trainable_sigma_range(self) -> tuple[float, float]:
        """[lo, hi]: the σ at which `velocity` runs the trained module; every σ (two-expert families narrow it)."""
        return 0.0, 1.0

    # ----------------------------------------------------------------------------------------- LoRA
    def _write_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict | None) -> None:
        type(self.pipe).save_lora_weights(
            str(folder),
            transformer_lora_layers=state_dict,
            transformer_lora_adapter_metadata=metadata,
            safe_serialization=True,
        )

    def _read_lora(self, path: Path, adapter_name: str) -> None:
        if path.is_dir():
            self.pipe.load_lora_weights(str(path), adapter_name=adapter_name)
        else:
            self.pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=adapter_name)


class PackedLatentsMixin:
    """Latents as 2x2-packed tokens [L, 4C] (FLUX.1, Qwen-Image): the pipeline's `_pack_latents` layout.

    A token sequence does not say its grid; `latent_shape(height, width)` records the (rows, columns) of each
    sequence length it lays out, which the position ids and `decode` read back.
    """

    pipe: Any
    transformer: torch.nn.Module

    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor * 2
        return 2 * (height // f), 2 * (width // f)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        seq_len = (h // 2) * (w // 2)
        self.__dict__.setdefault("_grid_by_seq_len", {})[seq_len] = (h // 2, w // 2)
        return (seq_len, self.transformer.config.in_channels)  # packed tokens [L, 4C]

    def image_seq_len(self, height: int, width: int, num_frames: int | None = None) -> int:
        return self.latent_shape(height, width)[0]

    def _noise_shape(self, num: int, height: int, width: int, num_frames: int | None) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        self.latent_shape(height, width)
        return (num, self.transformer.config.in_channels // 4, h, w)

    def _pack(self, noise: torch.Tensor) -> torch.Tensor:
        n, (c, h, w) = noise.shape[0], noise.shape[-3:]
        return self.pipe._pack_latents(noise, n, c, h, w)

    def _grid(self, seq_len: int) -> tuple[int, int]:
        """(rows, columns) of packed tokens for a sequence of `seq_len` tokens."""
        known = self.__dict__.get("_grid_by_seq_len", {})
        if seq_len in known:
            return known[seq_len]
        side = int(round(seq_len**0.5))
        if side * side != seq_len:
            raise ValueError(
                f"cannot infer the latent grid of {seq_len} {self.family} tokens; "
                "call latent_shape(height, width) first"
            )
        return side, side

    def _unpacked(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's `_unpack_latents` of packed tokens [N, L, 4C] at their recorded grid."""
        gh, gw = self._grid(latents.shape[1])
        f = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(latents, gh * 2 * f, gw * 2 * f, f)


def validate_pipeline_folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model={str(path)!r} is not a folder; pass a diffusers pipeline folder, a hub id or 'toy'"
        )
    if not (folder / "model_index.json").exists():
        raise FileNotFoundError(
            f"model={str(path)!r} has no model_index.json; pass the folder written by a pipeline's save_pretrained"
        )
    return folder
