"""LoRA on a model's `transformer` through peft: add, switch off (the reference model), save, load, and named
adapters beside the trained one (DiffusionNFT's sampling policy "old"): switch, copy, soft-update in place.

`LoRAMixin` is shared by every adapter. Diffusers-backed models write the adapter with their pipeline's
`save_lora_weights` (so `pipe.load_lora_weights(folder)` reads it); models without a pipeline (the toy)
write the same diffusers layout themselves: `pytorch_lora_weights.safetensors` with `transformer.`-prefixed
peft keys, the adapter config in the file's metadata.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# MMDiT joint attention (SD3, FLUX): the image stream's projections and the text stream's added ones
JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
METADATA_KEY = "lora_adapter_metadata"


class LoRAMixin:
    transformer: torch.nn.Module
    lora_target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    _lora_config: Any = None

    def add_lora(
        self,
        rank: int = 32,
        alpha: float | None = None,
        target_modules: tuple[str, ...] | None = None,
        init_lora_weights: str | bool = "gaussian",
        adapter_name: str = "default",
    ) -> None:
        """Add a trainable LoRA adapter to the transformer; only its weights require grad."""
        from peft import LoraConfig

        if rank < 1:
            raise ValueError(f"lora rank={rank} must be >= 1")
        self._lora_config = LoraConfig(
            r=rank,
            lora_alpha=alpha if alpha is not None else rank,
            init_lora_weights=init_lora_weights,
            target_modules=list(target_modules or self.lora_target_modules),
        )
        self.transformer.add_adapter(self._lora_config, adapter_name=adapter_name)
        self._set_active(adapter_name)
        for name, param in self.transformer.named_parameters():
            param.requires_grad_(f".{adapter_name}." in name and "lora_" in name)

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.transformer, "_hf_peft_config_loaded", False))

    def lora_state_dict(
        self, parameters: dict[str, torch.Tensor] | None = None, adapter_name: str = "default"
    ) -> dict[str, torch.Tensor]:
        """The adapter's peft state dict; from `parameters` (whole tensors by parameter name) when given, which
        is how a sharded run exports it without reading its sharded modules."""
        if parameters is not None:
            return {k.replace(f".{adapter_name}.", "."): v for k, v in parameters.items() if "lora_" in k}
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer, adapter_name=adapter_name)

    def _lora_metadata(self) -> dict | None:
        if self._lora_config is None:
            return None
        metadata = self._lora_config.to_dict()
        metadata["target_modules"] = sorted(metadata["target_modules"])
        return json.loads(json.dumps(metadata, default=str))

    def save_lora(self, folder: str | Path, parameters: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the adapter in the diffusers LoRA layout to `folder` (from `parameters` when given)."""
        if not self.has_lora:
            raise ValueError("the model has no LoRA adapter to save; call add_lora first or train with use_lora")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._write_lora(folder, self.lora_state_dict(parameters), self._lora_metadata())
        return folder

    def _write_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict | None) -> None:
        from safetensors.torch import save_file

        tensors = {f"transformer.{k}": v.detach().cpu().contiguous() for k, v in state_dict.items()}
        save_file(
            tensors, str(folder / WEIGHT_NAME), metadata={METADATA_KEY: json.dumps(metadata)} if metadata else None
        )

    def load_lora(self, path: str | Path, adapter_name: str = "default") -> None:
        """Load a LoRA written by save_lora (a folder or its .safetensors file)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"lora={str(path)!r} does not exist; pass a folder written by save_lora or a .safetensors file"
            )
        self._read_lora(path, adapter_name)
        self.transformer.eval()

    def _read_lora(self, path: Path, adapter_name: str) -> None:
        from peft import LoraConfig
        from peft.utils import set_peft_model_state_dict
        from safetensors import safe_open
        from safetensors.torch import load_file

        file = path / WEIGHT_NAME if path.is_dir() else path
        with safe_open(str(file), framework="pt") as handle:
            metadata = (handle.metadata() or {}).get(METADATA_KEY)
        if metadata is None:
            raise ValueError(
                f"lora={str(file)!r} has no adapter config in its metadata; write it with flowrl's save_lora"
            )
        config = json.loads(metadata)
        self._lora_config = LoraConfig(
            r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"]
        )
        self.transformer.add_adapter(self._lora_config, adapter_name=adapter_name)
        state = {k.removeprefix("transformer."): v for k, v in load_file(str(file)).items()}
        set_peft_model_state_dict(self.transformer, state, adapter_name=adapter_name)
        for param in self.transformer.parameters():
            param.requires_grad_(False)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference (base) model: LoRA layers switched off inside the block, on again after."""
        if not self.has_lora:
            raise RuntimeError(
                "adapter_disabled() needs a LoRA adapter; with full fine-tuning keep a frozen reference copy"
            )
        # peft's disable / enable also set requires_grad (off for all, then on for the active adapter only): the
        # trained / frozen split is put back as the recipe set it, whichever adapter is active
        with self._grad_flags_kept():
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()

    @contextlib.contextmanager
    def _grad_flags_kept(self) -> Iterator[None]:
        """Every transformer parameter's requires_grad as it was before the block (parameters added inside: frozen)."""
        flags = {id(p): p.requires_grad for p in self.transformer.parameters()}
        try:
            yield
        finally:
            for p in self.transformer.parameters():
                p.requires_grad_(flags.get(id(p), False))

    # ------------------------------------------------------------------------------------ named adapters
    @property
    def adapter_names(self) -> list[str]:
        """Names of the LoRA adapters on the transformer (the trained one is "default")."""
        return list(getattr(self.transformer, "peft_config", {}) or {})

    def adapter_parameters(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """The adapter's parameters by their full name (`...lora_A.<adapter_name>.weight`)."""
        if adapter_name not in self.adapter_names:
            raise KeyError(
                f"adapter {adapter_name!r} does not exist; adapters: {', '.join(self.adapter_names) or 'none'}"
            )
        tag = f".{adapter_name}."
        return {n: p for n, p in self.transformer.named_parameters() if "lora_" in n and tag in n}

    def _tuner_layers(self) -> Iterator[Any]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return (m for m in self.transformer.modules() if isinstance(m, BaseTunerLayer))

    def _set_active(self, adapter_name: str) -> None:
        # peft's own set_adapter also flips requires_grad (on for the active adapter, off for the others); a
        # sharded run (FSDP2) fixes a parameter's requires_grad when it first gathers it, so flowrl switches only
        # which adapter the layers compute and leaves the trained / frozen split as the recipe set it
        for layer in self._tuner_layers():
            layer._active_adapter = [adapter_name]

    def _active(self) -> str:
        layer = next(self._tuner_layers(), None)
        return "default" if layer is None else layer.active_adapters[0]

    @contextlib.contextmanager
    def using_adapter(self, adapter_name: str) -> Iterator[None]:
        """`velocity` computes with adapter `adapter_name` inside the block (no weights move, no grad flags change)."""
        if adapter_name not in self.adapter_names:
            raise KeyError(
                f"adapter {adapter_name!r} does not exist; adapters: {', '.join(self.adapter_names) or 'none'}"
            )
        previous = self._active()
        self._set_active(adapter_name)
        try:
            yield
        finally:
            self._set_active(previous)

    @torch.no_grad()
    def copy_adapter(self, source: str = "default", target: str = "old") -> None:
        """Make adapter `target` an exact, frozen copy of `source` (created with the same config when missing)."""
        if target not in self.adapter_names:
            active = self._active()
            # diffusers activates the new adapter through peft's set_adapter, which also flips requires_grad
            with self._grad_flags_kept(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # peft warns that a model gets one more adapter: intended
                self.transformer.add_adapter(self.transformer.peft_config[source], adapter_name=target)
            self._set_active(active)
        src, dst = self.adapter_parameters(source), self.adapter_parameters(target)
        for name, p in src.items():
            q = dst[name.replace(f".{source}.", f".{target}.")]
            q.data = p.detach().clone()
            q.requires_grad_(False)

    @torch.no_grad()
    def soft_update_adapter(self, target: str, source: str, decay: float) -> None:
        """In place: target <- decay * target + (1 - decay) * source (each process updates its own shards)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"adapter soft-update decay={decay} must be in [0, 1]")
        src, dst = self.adapter_parameters(source), self.adapter_parameters(target)
        for name, p in src.items():
            q = dst[name.replace(f".{source}.", f".{target}.")]
            if decay == 0.0:
                q.copy_(p)
            else:
                q.mul_(decay).add_(p.detach(), alpha=1.0 - decay)
