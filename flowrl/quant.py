"""Low-precision number formats (exact fake-quantization) and the preview models built from them.

    y = fake_quant_nvfp4(x)                  # NVFP4: 16-element blocks, E4M3 block scales, FP32 tensor scale
    y = fake_quant_mxfp4(x, rounding="floor")  # MXFP4: 32-element blocks, E8M0 (power-of-two) scales
    preview = build_preview(model.transformer, PreviewSpec(["fake_nvfp4"]))  # a quantized copy of the live policy

The formats and their rounding rules are in docs/math.md#low-precision-previews. All arithmetic
is float32; rounding is round-to-nearest-even throughout. Fake-quantization = dequantize(quantize(x)): the values
a real kernel would compute with, on any device, at fp32 speed or slower. Real low-precision speed needs the
torchao kernels (`nvfp4` on sm_100+, `fp8` on sm_89+); `auto` picks the one this device runs (`resolve_precision`),
and `check_preview_backend` refuses a kernel the run's device lacks when the config loads, before any model does.

A preview model is a copy of the current policy (the active LoRA adapter merged into the weights) with its
eligible linears replaced: `fake_*` layers hold their fake-quantized weight (quantized once per refresh) and
fake-quantize their input activations on every call; `int8` is torch's dynamic int8 quantization (CPU); `fp8` /
`nvfp4` are torchao's dynamic float8 / NVFP4 linears (real low-precision matmuls); `cached` turns on diffusers' cache
hooks on the copy. The sampler keeps one copy (`PreviewCache`): built at its first rollout, then written over in
place from the live weights whenever they changed (an optimizer step, another active adapter), so the preview always
follows the latest weights without a new copy of the model per rollout.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flowrl import work

E2M1_MAX = 6.0
E4M3_MAX = 448.0


# ------------------------------------------------------------------------------------------ element rounding
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to the even mantissa (0.25→0, 0.75→1, 2.5→2, 3.5→4, 5→4); |x| > 6 saturates to 6."""
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    # the grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; torch.round rounds half to even
    step = torch.where(a < 2, torch.full_like(a, 0.5), torch.where(a < 4, torch.ones_like(a), torch.full_like(a, 2.0)))
    return torch.copysign(torch.round(a / step) * step, x)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest FP8 E4M3 (e4m3fn) value, ties to even: 3 mantissa bits, normals down to 2^-6, subnormal step 2^-9;
    |x| > 448 saturates to 448 (e4m3fn has no infinity)."""
    x = x.float()
    a = x.abs().clamp(max=E4M3_MAX)
    _, exponent = torch.frexp(a)  # a = m · 2^exponent, m in [0.5, 1): floor(log2 a) = exponent - 1
    e = torch.clamp(exponent - 1, min=-6)  # below the smallest normal the spacing stays 2^-9
    step = torch.ldexp(torch.ones_like(a), e - 3)
    return torch.copysign(torch.round(a / step) * step, x).clamp(-E4M3_MAX, E4M3_MAX)


# ------------------------------------------------------------------------------------------ blocks
def _blocks(x: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, tuple]:
    """x with `axis` last, zero-padded to a multiple of `block`, as [..., num_blocks, block]; and how to undo it."""
    if block < 1:
        raise ValueError(f"block={block} must be >= 1")
    moved = x.float().movedim(axis, -1)
    size = moved.shape[-1]
    pad = (-size) % block
    if pad:
        moved = F.pad(moved, (0, pad))  # zeros change no block maximum
    return moved.reshape(*moved.shape[:-1], -1, block), (axis, size, moved.shape)


def _unblock(y: torch.Tensor, undo: tuple) -> torch.Tensor:
    axis, size, shape = undo
    return y.reshape(shape)[..., :size].movedim(-1, axis)


def nvfp4_scales(
    x: torch.Tensor, axis: int = -1, block: int = 16, two_level: bool = True, scale_floor: float = 2**-6, amax=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """NVFP4 quantization of x: (codes [..., nb, block] in E2M1, encoded block scales ê [..., nb, 1] in E4M3,
    the per-tensor scale S (1 for single-level), undo info). Dequantized value = codes · S · ê."""
    xb, undo = _blocks(x, axis, block)
    block_max = xb.abs().amax(dim=-1, keepdim=True)  # [..., nb, 1]
    if two_level:
        tensor_amax = xb.abs().max() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
        scale = (tensor_amax / (E4M3_MAX * E2M1_MAX)).float()  # S, FP32
        if float(scale) == 0.0:
            return torch.zeros_like(xb), torch.zeros_like(block_max), scale, undo
        encoded = round_e4m3((block_max / E2M1_MAX / scale).clamp(scale_floor, E4M3_MAX))  # ê_b
    else:
        scale = torch.ones((), dtype=torch.float32)
        encoded = round_e4m3((block_max / E2M1_MAX).clamp(scale_floor, E4M3_MAX))
    total = scale * encoded  # T_b
    codes = round_e2m1((xb / total).clamp(-E2M1_MAX, E2M1_MAX))
    return codes, encoded, scale, undo


def fake_quant_nvfp4(
    x: torch.Tensor, axis: int = -1, block: int = 16, two_level: bool = True, scale_floor: float = 2**-6, amax=None
) -> torch.Tensor:
    """dequant(quant(x)) in NVFP4 (docs/math.md#low-precision-previews): blocks of `block` elements along `axis`, E4M3
    block scales clipped at `scale_floor`, one FP32 tensor scale amax / (448·6) (`amax`: the tensor's own max |x| when
    None)."""
    codes, encoded, scale, undo = nvfp4_scales(x, axis, block, two_level, scale_floor, amax)
    return _unblock(codes * (scale * encoded), undo)


def mxfp4_exponents(block_max: torch.Tensor, rounding: str = "floor") -> torch.Tensor:
    """Shared E8M0 exponent per block: floor(log2 max|X_b|) − 2 ('floor', the OCP spec) or ceil(log2(max|X_b| / 6))
    ('rceil'); clamped to the E8M0 range [−127, 127]."""
    mantissa, exponent = torch.frexp(block_max.float())
    if rounding == "floor":
        shared = exponent - 1 - 2  # floor(log2 a) = exponent - 1; emax of E2M1 = 2
    elif rounding == "rceil":
        mantissa, exponent = torch.frexp(block_max.float() / E2M1_MAX)
        shared = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2 y): exact powers of two stay
    else:
        raise ValueError(f"rounding={rounding!r} must be 'floor' (the OCP spec) or 'rceil'")
    return shared.clamp(-127, 127)


def fake_quant_mxfp4(x: torch.Tensor, axis: int = -1, block: int = 32, rounding: str = "floor") -> torch.Tensor:
    """dequant(quant(x)) in MXFP4: blocks of `block` along `axis`, one power-of-two scale 2^shared_exp each
    (`mxfp4_exponents`), E2M1 elements; values in (6, 8)·scale saturate to 6 under 'floor'. Zero blocks stay 0."""
    xb, undo = _blocks(x, axis, block)
    block_max = xb.abs().amax(dim=-1, keepdim=True)
    scale = torch.ldexp(torch.ones_like(block_max), mxfp4_exponents(block_max, rounding))
    y = round_e2m1((xb / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return _unblock(torch.where(block_max > 0, y, torch.zeros_like(y)), undo)


def fake_quant_fp8(x: torch.Tensor, amax=None) -> torch.Tensor:
    """dequant(quant(x)) in FP8 E4M3 with one per-tensor scale amax / 448 (torchao's dynamic float8 recipe)."""
    tensor_amax = x.detach().abs().max().float() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    if float(tensor_amax) == 0.0:
        return torch.zeros_like(x, dtype=torch.float32)
    scale = tensor_amax / E4M3_MAX
    return round_e4m3((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)) * scale


FAKE_QUANT = {"fake_nvfp4": fake_quant_nvfp4, "fake_mxfp4": fake_quant_mxfp4, "fake_fp8": fake_quant_fp8}


class FakeQuantLinear(torch.nn.Module):
    """A linear layer in a low-precision format: its weight fake-quantized once (per output row, blocks along the
    input dimension), its input activations fake-quantized on every call (blocks along the last dimension), the
    product and the bias in float32."""

    def __init__(self, linear: torch.nn.Linear, fmt: str):
        super().__init__()
        self.fmt, self.quant = fmt, FAKE_QUANT[fmt]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = self.quant(linear.weight.detach().float())
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(self.quant(x.float()), self.weight, self.bias)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, format={self.fmt}"


# ------------------------------------------------------------------------------------------ preview models
BACKENDS = ("auto", "fake_nvfp4", "fake_mxfp4", "fake_fp8", "nvfp4", "fp8", "int8", "bf16", "few_step", "cached")
PRECISIONS = ("auto", "fake_nvfp4", "fake_mxfp4", "fake_fp8", "nvfp4", "fp8", "int8", "bf16")  # at most one of these
KERNELS = {"nvfp4": (10, 0), "fp8": (8, 9)}  # torchao's kernels and the CUDA capability they need
DEFAULT_SKIP = ("embed", "caption_projection", "proj_out", "norm_out", "time_proj")
CACHES = {"first_block": "FirstBlockCacheConfig", "mag": "MagCacheConfig", "taylorseer": "TaylorSeerCacheConfig"}


@dataclass
class PreviewSpec:
    """How the cheap preview model differs from the policy (the candidates sampler's `preview_*` fields)."""

    backends: list[str] = field(default_factory=lambda: ["fake_nvfp4"])
    """Any of BACKENDS, combined (at most one precision): e.g. ['few_step', 'int8']."""
    skip: tuple[str, ...] = DEFAULT_SKIP
    """Linears whose qualified name contains one of these stay at full precision (embedders, the final layer)."""
    min_features: int = 0
    """Linears with max(in, out) <= this stay at full precision (Sol-RL's SANA config: 2240)."""
    cache: dict = field(default_factory=lambda: {"type": "first_block", "threshold": 0.2})
    """The `cached` backend: type (first_block, mag, taylorseer) and that diffusers config's arguments."""

    def __post_init__(self) -> None:
        self.backends = [self.backends] if isinstance(self.backends, str) else list(self.backends)
        for b in self.backends:
            if b not in BACKENDS:
                raise ValueError(f"sampler.preview_backend={b!r} is not one of {', '.join(BACKENDS)}")
        precisions = [b for b in self.backends if b in PRECISIONS]
        if len(precisions) > 1:
            raise ValueError(f"sampler.preview_backend combines {' and '.join(precisions)}; keep at most one precision")
        if "cached" in self.backends and self.cache.get("type") not in CACHES:
            raise ValueError(
                f"sampler.preview_cache.type={self.cache.get('type')!r} must be one of {', '.join(CACHES)}"
            )

    @property
    def precision(self) -> str | None:
        return next((b for b in self.backends if b in PRECISIONS), None)


def parse_backend(value: str | list[str]) -> list[str]:
    """'few_step+int8' or ['few_step', 'int8'] -> ['few_step', 'int8']."""
    return [b.strip() for b in value.split("+")] if isinstance(value, str) else list(value)


def quantizable_linears(module: torch.nn.Module, skip=DEFAULT_SKIP, min_features: int = 0) -> list[str]:
    """Qualified names of the nn.Linear layers a preview quantizes (not skipped by name, larger than min_features)."""
    return [
        name
        for name, m in module.named_modules()
        if type(m) is torch.nn.Linear
        and not any(s in name for s in skip)
        and max(m.in_features, m.out_features) > min_features
    ]


def _replace(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


@torch.no_grad()
def merged_copy(transformer: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the transformer computing what it computes now: each LoRA layer's active adapter merged
    into its base weight (W + s·B·A) and the LoRA layer replaced by that base layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    clone = copy.deepcopy(transformer)
    layers = [(n, m) for n, m in clone.named_modules() if isinstance(m, BaseTunerLayer)]
    for name, layer in layers:
        base = layer.get_base_layer()
        if not layer.disable_adapters:
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_A", {}):
                    base.weight.data += layer.get_delta_weight(adapter).to(base.weight.dtype)
        _replace(clone, name, base)
    clone.requires_grad_(False)
    return clone.eval()


# ------------------------------------------------------------------------------------------ which precision runs here
def run_device(device: str | None) -> torch.device:
    """The device a run config's `device` names, known before anything loads: None is accelerate's choice (the GPU
    when one is present)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _capability(device: torch.device) -> tuple[int, int] | None:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def resolve_precision(precision: str | None, device: str | torch.device) -> str | None:
    """The precision a preview runs at on `device`: `auto` is nvfp4 on sm_100+ (Blackwell), fp8 on sm_89+ (Ada,
    Hopper) and elsewhere fake_nvfp4 (the exact emulation, as on the CPU); any other precision is itself."""
    if precision != "auto":
        return precision
    capability = _capability(torch.device(device))
    if capability is None or capability < KERNELS["fp8"]:
        return "fake_nvfp4"
    return "nvfp4" if capability >= KERNELS["nvfp4"] else "fp8"


def check_precision(precision: str | None, device: str | torch.device, requested: str | None = None) -> None:
    """A one-line ValueError where torchao's kernels for `precision` cannot run on `device` (`requested`: what the
    config named, `auto` or the precision itself)."""
    if precision not in KERNELS:
        return
    device, requested = torch.device(device), requested or precision
    need, capability = KERNELS[precision], _capability(torch.device(device))
    if capability is None or capability < need:
        where = "the CPU" if device.type == "cpu" else device.type
        if capability is not None:
            where = "an sm_{}{} GPU".format(*capability)
        other = (
            "fp8"
            if precision == "nvfp4" and capability is not None and capability >= KERNELS["fp8"]
            else f"fake_{precision}"
        )
        raise ValueError(
            f"sampler.preview_backend={precision!r} needs torchao kernels on an sm_{need[0]}{need[1]}+ GPU; this run "
            f"has {where}: use auto ({resolve_precision('auto', device)} here) or {other}"
        )
    if not torchao_installed():
        raise ValueError(
            f"sampler.preview_backend={requested!r} runs {precision} through torchao, which is not installed: "
            "pip install 'flowrl[cuda]' (torchao>=0.18), or name a fake_* precision"
        )


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_preview_backend(backend: str | list[str], device: str | None) -> str | None:
    """The candidates sampler's preview precision against the run's device (`device`: the run config's), when the config
    loads and before any model does: a one-line ValueError for kernels this machine lacks; for `auto`, the line that
    says what it chose (None otherwise)."""
    backends = parse_backend(backend)
    precision = next((b for b in backends if b in PRECISIONS), None)
    if precision != "auto" and precision not in KERNELS:
        return None
    where = run_device(device)
    chosen = resolve_precision(precision, where)
    check_precision(chosen, where, precision)
    if precision != "auto":
        return None
    capability = _capability(where)
    on = "the CPU" if capability is None else "sm_{}{}".format(*capability)
    how = "torchao kernels" if chosen in KERNELS else "exact emulation, no low-precision kernels"
    return f"sampler.preview_backend={'+'.join(backends)}: auto runs previews at {chosen} on {on} ({how})"


def _torchao_config(precision: str):
    """torchao's quantization config for a real low-precision preview (torchao 0.18's names)."""
    if precision == "fp8":  # dynamic per-tensor float8 activations and weights: torch._scaled_mm on sm_89+
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

        return Float8DynamicActivationFloat8WeightConfig()
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

    # its fused Triton activation kernel comes with the separate `mslk` package; without it torchao's own path
    return NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=importlib.util.find_spec("mslk") is not None)


def _torchao_quantize(model: torch.nn.Module, precision: str, names: set[str]) -> None:
    from torchao.quantization import quantize_

    quantize_(model, _torchao_config(precision), filter_fn=lambda m, fqn: fqn in names)


def _enable_cache(model: torch.nn.Module, cache: dict, family: str) -> None:
    if not hasattr(model, "enable_cache"):
        raise ValueError(
            f"sampler.preview_backend='cached' needs diffusers cache hooks; the {family} transformer "
            f"({type(model).__name__}) has none (FLUX and Wan have them): choose another preview_backend"
        )
    import diffusers

    options = {k: v for k, v in cache.items() if k != "type"}
    try:
        model.enable_cache(getattr(diffusers, CACHES[cache["type"]])(**options))
    except IndexError:  # FirstBlockCache splits the blocks into a head and a tail
        raise ValueError(
            f"sampler.preview_cache.type={cache['type']!r} needs at least two transformer blocks; the {family} "
            "transformer has one: use type taylorseer or mag"
        ) from None


def build_preview(transformer: torch.nn.Module, spec: PreviewSpec, family: str = "model") -> torch.nn.Module:
    """The preview copy of the live transformer (see the module docstring); `few_step` and `bf16` act in the sampler."""
    return _build(transformer, spec, family)[0]


def _build(
    transformer: torch.nn.Module, spec: PreviewSpec, family: str
) -> tuple[torch.nn.Module, str | None, list[str]]:
    """(the preview, the precision it runs at on this device, the names of its quantized linears)."""
    device = next(transformer.parameters()).device
    precision = resolve_precision(spec.precision, device)
    check_precision(precision, device, spec.precision)
    if precision == "int8" and device.type != "cpu":
        raise ValueError(
            f"sampler.preview_backend='int8' is torch's dynamic quantization for the CPU; this run is on {device}"
        )
    if "cached" in spec.backends and not hasattr(transformer, "enable_cache"):
        _enable_cache(transformer, spec.cache, family)  # raises the one-line error before copying anything
    if precision in (None, "bf16") and "cached" not in spec.backends:
        # few_step / bf16 change how the sampler runs the policy, not its weights: no copy
        return transformer, precision, []
    preview = merged_copy(transformer)
    names = quantizable_linears(preview, spec.skip, spec.min_features) if precision not in (None, "bf16") else []
    if precision in KERNELS:  # torchao's fp8 and nvfp4 linears need both sides in multiples of 16
        names = [
            n
            for n in names
            if preview.get_submodule(n).in_features % 16 == 0 == preview.get_submodule(n).out_features % 16
        ]
    if precision in FAKE_QUANT:
        for name in names:
            _replace(preview, name, FakeQuantLinear(preview.get_submodule(name), precision))
    elif precision == "int8":
        preview = torch.ao.quantization.quantize_dynamic(preview, set(names), dtype=torch.qint8)
    elif precision in KERNELS:
        _torchao_quantize(preview, precision, set(names))
    if "cached" in spec.backends:
        _enable_cache(preview, spec.cache, family)
    # the work meter (flowrl.work) prices the preview's forwards at its backend
    preview.flowrl_backend = "+".join(
        [precision] * (precision not in (None, "bf16")) + ["cached"] * ("cached" in spec.backends)
    )
    work.meter_transformer(preview)
    return preview, precision, names


# ------------------------------------------------------------------------------------------ one copy, refreshed
def weights_stamp(module: torch.nn.Module) -> tuple:
    """What changes when a weight `module` computes with changes: each tensor's storage and in-place version counter
    (an optimizer step, `copy_`, `p.data = ...`) and each LoRA layer's active adapters and switch."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tensors = [getattr(t, "_local_tensor", t) for t in itertools.chain(module.parameters(), module.buffers())]
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    adapters = tuple((tuple(m.active_adapters), bool(m.disable_adapters)) for m in layers)
    return tuple((t.data_ptr(), t._version) for t in tensors), adapters


def _live_tensors(live: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of the preview's module at the same name, from the live module: a LoRA layer's base layer with the
    active adapters merged into its weight (the arithmetic of `merged_copy`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not isinstance(live, BaseTunerLayer):
        return dict(itertools.chain(live.named_parameters(recurse=False), live.named_buffers(recurse=False)))
    base = live.get_base_layer()
    tensors = dict(itertools.chain(base.named_parameters(recurse=False), base.named_buffers(recurse=False)))
    weight = base.weight.detach().clone()
    if not live.disable_adapters:
        for adapter in live.active_adapters:
            if adapter in getattr(live, "lora_A", {}):
                weight += live.get_delta_weight(adapter).to(weight.dtype)
    tensors["weight"] = weight
    return tensors


def _requantized(weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> torch.nn.Module:
    """A fresh int8 or torchao linear for `weight` and `bias`, as `_build` makes it."""
    shell = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    shell.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        shell.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    if precision == "int8":  # what quantize_dynamic does to each linear it names
        shell.qconfig = torch.ao.quantization.default_dynamic_qconfig
        return torch.ao.nn.quantized.dynamic.Linear.from_float(shell)
    from torchao.quantization import quantize_

    quantize_(shell, _torchao_config(precision))
    return shell


@torch.no_grad()
def refresh_preview(preview: torch.nn.Module, transformer: torch.nn.Module, precision: str | None, names) -> None:
    """Write the live transformer's weights (its active LoRA merged) into `preview`, a copy `_build` made of it with
    the quantized linears `names`, in place: those re-quantized, every other tensor copied. The result equals a new
    `build_preview` of the live weights bit for bit, without a new copy of the model."""
    quantized = tuple(names)
    inside = tuple(f"{n}." for n in quantized)  # int8's packed parameters: nothing of the live model
    for name, module in list(preview.named_modules()):
        if inside and name.startswith(inside):
            continue
        live = _live_tensors(transformer.get_submodule(name))
        if name in quantized:
            weight, bias = live["weight"], live.get("bias")
            if isinstance(module, FakeQuantLinear):
                module.weight.copy_(module.quant(weight.detach().float()))
                if bias is not None:
                    module.bias.copy_(bias.detach().float())
            else:
                _replace(preview, name, _requantized(weight, bias, precision))
            continue
        for key, tensor in itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            tensor.copy_(live[key])


class PreviewCache:
    """The candidates sampler's one preview copy of the live transformer: built at the first call, then refreshed in
    place (`refresh_preview`) when the step or the live weights changed since the last call, so the rollout chunks of
    one training step share one quantization and no step copies the model. The copy stays allocated between steps."""

    def __init__(self, spec: PreviewSpec):
        self.spec = spec
        self.preview = self.source = self.stamp = None
        self.precision, self.names = None, []
        self.counts = {"builds": 0, "refreshes": 0, "reuses": 0}

    def __call__(self, transformer: torch.nn.Module, family: str = "model", step: int = 0) -> torch.nn.Module:
        stamp = (step, weights_stamp(transformer))
        if self.preview is None or self.source is not transformer:
            self.preview, self.precision, self.names = _build(transformer, self.spec, family)
            self.source = transformer
            self.counts["builds"] += 1
        elif stamp != self.stamp and self.preview is not transformer:
            refresh_preview(self.preview, transformer, self.precision, self.names)
            self.counts["refreshes"] += 1
        else:
            self.counts["reuses"] += 1
        self.stamp = stamp
        return self.preview
