"""Peak memory per GPU of a training run: activations counted from a real forward, the rest from parameter counts.

    count = count_activations(meta_transformer, make_inputs, rows=8, checkpointing=True, working=True)
    plan = MemoryPlan(params=..., lora_params=..., rows=8, checkpointing=True,
                      activation_row_bytes={(True, True): count.total / 8}, transient_bytes={(True, True): count.transient})
    parts = estimate_peak(plan)                   # GiB per component and "total"
    if not fits(parts["total"], 80):
        print(suggestion(plan, 80))               # the changes that bring it under, each computed
    peak = measure_peak(step, alive=[transformer, optimizer])  # bytes: the CPU measurement estimates are checked against

**Activations are counted, not assumed.** `activation_bytes` runs one forward with grad under
`torch.autograd.graph.saved_tensors_hooks` and sums the storages of the tensors autograd saves for backward, each
storage once however many views of it are saved; storages of the module's parameters and buffers are weights, not
activations. The module trains as it is given: with LoRA (added as flowrl.models.lora does: `with_lora`), a frozen
base layer saves no input for a weight gradient, but every LoRA layer saves its input. It runs on the meta device (a
real architecture built under `torch.device("meta")`, meta inputs: no memory, seconds) and on the CPU, and counts in
the dtypes the forward computes in (autocast does not apply on meta: cast the module, LoRA included, to the compute
dtype to count a 16-bit run there). On meta, `scaled_dot_product_attention` is counted as the fused kernels save it
(query, key, value, output and a float32 log-sum-exp per query: CUDA's flash and memory-efficient kernels and the CPU
flash kernel); torch's meta dispatch would otherwise take the math path, which keeps the S x S probabilities.

**Gradient checkpointing** (diffusers' `enable_gradient_checkpointing`, non-reentrant `torch.utils.checkpoint`). What
the hooks see under it: the checkpoint saves each block's tensor inputs as saved tensors of its own, outside the block,
so the outer hooks see those inputs (and everything saved outside the blocks); inside a block the checkpoint installs
its own hooks, which store placeholders and let the tensors go, so nothing saved inside a block reaches the outer
hooks. In backward each block is recomputed, one at a time, and holds its activations until its backward is done. So
the count with checkpointing is the storages the outer hooks see (block inputs and what lives outside the blocks)
plus the largest block's own activations, counted by running each block once more, unchecked, under hooks of its own
(storages the outer count already holds, such as the block's inputs, are not counted twice). The checkpointing
function handed to diffusers does that count and then calls the real non-reentrant checkpoint, so the outer count is
what training keeps.

**The working peak** (`count_activations(..., working=True)`): saved tensors are not all a backward holds; the
operator being run holds its output, and backward holds the gradients flowing back. In a deep model that is little
(SD3.5-Medium, counted on meta: 1-2%); in a shallow one it matters (the one-block tiny SD3 transformer peaks at
about 1.6x its saved tensors). So a second forward and a backward from the output run under the storage tracker of
`measure_peak` (on meta too: sizes without memory), with the trained parameters' gradients made beforehand so that
they do not count; `transient` = that peak - the saved count (0 when the saved count is the larger, as
checkpointing's "largest block" can be: it is an upper bound of the recomputation).

**The estimate** (`estimate_peak`) adds, per GPU, in GiB (2^30 bytes), following flowrl's training code:

- `weights`: what the transformer holds that does not train: with LoRA the base weights in `weight_dtype` and frozen
  adapter copies (float32); with full fine-tuning, a frozen float32 copy of the starting weights where the recipe keeps
  one (`reference_copy`). Its buffers. Under FSDP2 the module's parameters are sharded (divided by the GPU count) and
  the largest block is gathered whole, twice with prefetch (`largest_block_params`).
- `trainable`: the trained parameters, float32 (`build_policy` casts them; autocast computes in 16 bits). DeepSpeed's
  fp16 engine (ZeRO-2 with `mixed_precision: fp16`) holds them in float16 and keeps float32 masters (in `optimizer`).
- `gradients`: one per trained parameter in its dtype (float32); ZeRO-2 and FSDP2 divide them by the GPU count.
- `optimizer`: AdamW's two float32 moments per trained parameter (plus the float32 masters of DeepSpeed's fp16
  engine); divided by the GPU count under ZeRO-2 and FSDP2. OptimizerStep keeps no other master copy: the trained
  parameters are themselves float32.
- `ema`: one float32 copy of the trained parameters (flowrl.training.optim.EMA); divided under FSDP2 (the copies are
  made from the shards), whole under ZeRO-2 and data parallel.
- `activations`: `activation_row_bytes[(use_lora, checkpointing)]` x `rows` (the rows of one micro-batch: the
  minibatch one backward runs on, x 2 with true CFG); `transient`: `transient_bytes` of that mode. Not divided by any
  sharding.
- `frozen`: text encoders, VAE and reward models resident in their dtype; 0 for those offloaded to the CPU.
- `overhead`: `OVERHEAD_GIB` for the CUDA context, NCCL buffers and allocator fragmentation (GPU estimates only).
- `total`: the sum. Gradients are counted together with the activations because flowrl's recipes run more than one
  backward per optimizer step (a GRPO step trains every transition of the SDE window, one backward each), so the
  gradients of the earlier ones are held through the next forward; with a single backward per step this overstates
  the peak by at most the gradients.

Sharding: "none" (data parallel: every GPU holds everything), "fsdp" (FSDP2: weights, gradients, optimizer state and
EMA divided), "zero2" (DeepSpeed ZeRO-2: gradients and optimizer state divided, weights whole).

**The measurement** (`measure_peak`) is exact for tensor storage on the CPU: a `TorchDispatchMode` sees every
operator's outputs; each storage not seen before is added with its size and a weak reference whose callback
subtracts it when the storage is freed (torch keeps one Python object per live storage, so the reference dies with
the storage, not with a view), and the peak is taken after every operator. Storages alive before (parameters,
buffers, optimizer state, inputs) are added first, with the same callbacks, so freeing one of them counts too, and a
view of a weight is never taken for a new tensor. What it cannot see: scratch memory a kernel allocates and frees
inside one operator, and allocator overhead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 1024**3
MIB = 1024**2
OVERHEAD_GIB = 3.0  # CUDA context (~0.5-1 GiB), NCCL buffers, caching-allocator fragmentation: an assumption
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1}
SHARDINGS = ("none", "fsdp", "zero2")
MIXED_PRECISION = ("fp32", "bf16", "fp16")


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given as a torch.dtype or its name ("bfloat16", "torch.float16", "fp32")."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if name not in BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(BYTES)}")
    return BYTES[name]


# ------------------------------------------------------------------------------------------ tensors and storages


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage (one Python object per storage while it lives: torch preserves it), or None (no storage:
    sparse, nested or wrapper tensors)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensors_of(*objects: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `objects`: modules (parameters, their gradients, buffers), optimizers (state), tensors (and the
    gradient of a leaf) and nested lists, tuples and dicts of them."""
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.is_leaf and obj.grad is not None:
                yield obj.grad
        elif isinstance(obj, torch.nn.Module):
            yield from tensors_of(list(obj.parameters()), list(obj.buffers()))
        elif isinstance(obj, torch.optim.Optimizer):
            yield from tensors_of([state for state in obj.state.values()])
        elif isinstance(obj, Mapping):
            yield from tensors_of(*obj.values())
        elif isinstance(obj, list | tuple | set):
            yield from tensors_of(*obj)


def storage_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages of the tensors in `objects` (see `tensors_of`); a storage shared by views
    counts once."""
    seen: dict[int, int] = {}
    for t in tensors_of(*objects):
        s = _storage(t)
        if s is not None:
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def param_count(module: torch.nn.Module, trainable: bool | None = None) -> int:
    """Parameters of `module`: all (None), the trained ones (True) or the frozen ones (False)."""
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


def with_lora(module: torch.nn.Module, rank: int, targets: Iterable[str], alpha: float | None = None) -> torch.nn.Module:
    """`module` with a LoRA adapter added exactly as flowrl's models add one (flowrl.models.lora.LoRAMixin.add_lora:
    peft, only the adapter requires grad); works on the meta device. Returns the module."""
    from flowrl.models.lora import LoRAMixin

    holder = LoRAMixin()
    holder.transformer = module
    holder.add_lora(rank=rank, alpha=alpha, target_modules=tuple(targets))
    return module


# ------------------------------------------------------------------------------------------ activations


class _SavedStorages:
    """A pack hook that records the distinct storages of saved tensors, leaving out `excluded` storage ids (weights);
    the tensors themselves are returned unchanged, so backward works as without it."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.storages: dict[int, torch.UntypedStorage] = {}  # id -> storage, held so that an id stays unique

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = _storage(t)
        if s is not None and id(s) not in self.excluded:
            self.storages.setdefault(id(s), s)
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def bytes(self, leaving_out: Iterable[int] = ()) -> int:
        skip = set(leaving_out)
        return sum(s.nbytes() for key, s in self.storages.items() if key not in skip)


class _FusedAttentionOnMeta(TorchFunctionMode):
    """On the meta device, `scaled_dot_product_attention` runs as the CPU flash kernel's meta implementation, so that
    autograd saves what the fused kernels save (q, k, v, output, float32 log-sum-exp) instead of the math path's
    S x S probabilities."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        # positional (diffusers' attention processors) or by keyword (its attention dispatcher)
        named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args))
        named.update(kwargs)
        q, k, v = named.get("query"), named.get("key"), named.get("value")
        fused = q is not None and q.device.type == "meta" and not named.get("enable_gqa", False)
        if fused and q.shape[:-2] == k.shape[:-2]:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q,
                k,
                v,
                named.get("dropout_p", 0.0),
                named.get("is_causal", False),
                attn_mask=named.get("attn_mask"),
                scale=named.get("scale"),
            )[0]
        return func(*args, **kwargs)


@dataclass
class ActivationCount:
    """What one forward with grad keeps for backward, in bytes: `kept` (the storages the hooks see: everything without
    checkpointing; with it, the checkpointed blocks' inputs and what lives outside the blocks), `blocks` (each
    checkpointed block's own activations, recomputed in backward one block at a time) and `total` = kept + the
    largest block. `working` (counted when asked for): the peak of live storage over the forward and a backward from
    the output, beyond the weights and the gradients already held; `transient` = working - total, what the operator
    being run holds besides the saved tensors (its output, the gradients flowing back)."""

    kept: int
    blocks: list[int] = field(default_factory=list)
    working: int | None = None

    @property
    def largest_block(self) -> int:
        return max(self.blocks, default=0)

    @property
    def total(self) -> int:
        return self.kept + self.largest_block

    @property
    def transient(self) -> int:
        return max(0, (self.working or 0) - self.total)


def _call(module: Callable, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, list | tuple):
        return module(*inputs)
    return module(inputs)


def _output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, a tuple, a diffusers output dict) that carry a gradient."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, list | tuple) else ()
    return [t for v in values for t in _output_tensors(v)]


@contextlib.contextmanager
def _checkpointing_set(module: torch.nn.Module, func: Callable | None) -> Iterator[None]:
    """Inside the block, every diffusers submodule that can checkpoint does so through `func` (None: checkpointing
    off); the flags and functions the modules had are put back after."""
    subs = [m for m in module.modules() if hasattr(m, "gradient_checkpointing")]
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in subs]
    if func is not None:
        if not hasattr(module, "enable_gradient_checkpointing") or not subs:
            raise ValueError(f"{type(module).__name__} has no gradient checkpointing to count (a diffusers model has)")
        module.enable_gradient_checkpointing(gradient_checkpointing_func=func)
    else:
        for m in subs:
            m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m, flag, fn in saved:
            m.gradient_checkpointing = flag
            if fn is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = fn


def _checkpoint(block: Callable, *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint of one block, as diffusers' default gradient checkpointing function calls it; the block
    runs under `_FusedAttentionOnMeta` in the forward and in its recomputation during backward (a torch-function mode
    is not active inside the backward call itself)."""
    fn = block.__call__ if isinstance(block, torch.nn.Module) else block

    def run(*a: Any, **k: Any) -> Any:
        with _FusedAttentionOnMeta():
            return fn(*a, **k)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _storage_ids(*objects: Any) -> set[int]:
    return {id(s) for t in tensors_of(*objects) if (s := _storage(t)) is not None}


def _saved(module: torch.nn.Module, inputs: Any, checkpointing: bool) -> ActivationCount:
    """The saved-tensor count of one forward (see the module docstring)."""
    weights = _storage_ids(list(module.parameters()), list(module.buffers()))
    outer = _SavedStorages(weights)
    blocks: list[int] = []
    depth = [0]

    def counting_checkpoint(block: Callable, *args: Any, **kwargs: Any) -> Any:
        if depth[0] == 0:  # the block's own activations: one unchecked forward under hooks of its own
            fn = block.__call__ if isinstance(block, torch.nn.Module) else block
            inner = _SavedStorages(weights)
            depth[0] += 1
            try:
                with inner.hooks():
                    out = fn(*args, **kwargs)
                del out
            finally:
                depth[0] -= 1
            blocks.append(inner.bytes(leaving_out=_storage_ids(list(args), kwargs)))
        return _checkpoint(block, *args, **kwargs)

    with (
        _checkpointing_set(module, counting_checkpoint if checkpointing else None),
        _FusedAttentionOnMeta(),
        torch.enable_grad(),
        outer.hooks(),
    ):
        out = _call(module, inputs)
    kept = outer.bytes()
    del out
    return ActivationCount(kept=kept, blocks=blocks)


def _working(module: torch.nn.Module, inputs: Any, checkpointing: bool) -> int:
    """Peak live storage of one forward and a backward from the output (gradient of ones), beyond the weights: the
    inputs count, the trained parameters' gradients are made beforehand (held, as when an earlier backward of the
    optimizer step made them: the new ones are added in place) and do not."""
    trained = [p for p in module.parameters() if p.requires_grad]
    held = [p.grad for p in trained]
    for p in trained:
        p.grad = torch.zeros_like(p)
    tracker = _LiveStorages(meta=True)
    for t in tensors_of(module):  # weights, buffers and the held gradients: there before, not counted
        tracker.add(t)
    before = tracker.now
    for t in tensors_of(inputs):
        tracker.add(t)
    try:
        with _checkpointing_set(module, _checkpoint if checkpointing else None), torch.enable_grad(), tracker:
            with _FusedAttentionOnMeta():
                out = _call(module, inputs)
            outs = _output_tensors(out)
            if not outs:
                raise ValueError(f"{type(module).__name__}'s output carries no gradient: nothing in it trains")
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            del out, outs
    finally:
        for p, g in zip(trained, held):
            p.grad = g
        tracker.sizes.clear()
    return tracker.peak - before


def count_activations(
    module: torch.nn.Module,
    make_inputs: Callable[[int], Any],
    rows: int = 1,
    checkpointing: bool = False,
    working: bool = False,
) -> ActivationCount:
    """The bytes one forward with grad of `module(**make_inputs(rows))` keeps for backward (see the module docstring);
    `make_inputs` returns a dict (keyword arguments), a tuple (positional ones) or one tensor. `working`: also run a
    forward and backward under the storage tracker for the working peak (on the meta device it costs nothing)."""
    count = _saved(module, make_inputs(rows), checkpointing)
    if working:
        count.working = _working(module, make_inputs(rows), checkpointing)
    return count


def activation_bytes(
    module: torch.nn.Module, make_inputs: Callable[[int], Any], rows: int = 1, checkpointing: bool = False
) -> int:
    """Bytes autograd keeps for backward from one forward with grad of `rows` rows, counted with saved-tensor hooks
    (unique storages, parameters and buffers left out); with `checkpointing`, the blocks' inputs plus the largest
    block's recomputed activations. Works on the meta device and on the CPU."""
    return count_activations(module, make_inputs, rows, checkpointing).total


# ------------------------------------------------------------------------------------------ the estimate


@dataclass(frozen=True)
class Frozen:
    """A frozen model resident beside the transformer (text encoder, VAE, reward model): `params` in `dtype`; 0 bytes
    on the GPU when `offloaded`. `offloadable` marks the text encoders (`model.offload_text_encoders`)."""

    name: str
    params: int
    dtype: str | torch.dtype = "bfloat16"
    offloaded: bool = False
    offloadable: bool = False

    @property
    def bytes(self) -> int:
        return 0 if self.offloaded else self.params * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class MemoryPlan:
    """What the peak of a training run depends on (see the module docstring for how each term is counted).

    `activation_row_bytes` maps (use_lora, checkpointing) to the bytes `activation_bytes` counts per row in that mode
    (its count at `rows` divided by `rows`: saved activations grow linearly with the rows); the plan's own mode must be
    there, the others let `suggestion` try them. `transient_bytes` maps the same modes to `ActivationCount.transient`
    counted at `rows` (kept when a suggestion lowers the rows: an upper bound there)."""

    params: int  # transformer parameters, without LoRA
    activation_row_bytes: Mapping[tuple[bool, bool], float]
    transient_bytes: Mapping[tuple[bool, bool], int] = field(default_factory=dict)
    rows: int = 1  # rows of one micro-batch (the minibatch one backward runs on)
    use_lora: bool = True
    lora_params: int = 0  # the trained adapter's parameters
    checkpointing: bool = False
    weight_dtype: str | torch.dtype = "bfloat16"  # model.dtype: frozen weights
    mixed_precision: str = "bf16"  # model.mixed_precision
    buffer_bytes: int = 0  # the transformer's buffers (positional tables), resident
    reference_copy: bool = False  # full fine-tuning: a frozen float32 copy of the starting weights
    adapter_copies: int = 0  # frozen float32 copies of the adapter (an old / sampling policy)
    use_ema: bool = False
    frozen: tuple[Frozen, ...] = ()
    sharding: str = "none"  # "none" (data parallel), "fsdp" (FSDP2), "zero2" (DeepSpeed ZeRO-2)
    num_gpus: int = 1
    largest_block_params: int = 0  # FSDP2 gathers one block whole (two with prefetch)
    gpu: bool = True  # count OVERHEAD_GIB (a GPU estimate); False for a CPU run
    overhead_gib: float = OVERHEAD_GIB

    def __post_init__(self):
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} must be one of {', '.join(SHARDINGS)}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be one of {', '.join(MIXED_PRECISION)}")
        if self.num_gpus < 1 or self.rows < 1:
            raise ValueError(f"num_gpus={self.num_gpus} and rows={self.rows} must be >= 1")
        if self.use_lora and self.lora_params <= 0:
            raise ValueError("use_lora needs lora_params > 0 (the adapter's parameter count)")
        if (self.use_lora, self.checkpointing) not in self.activation_row_bytes:
            raise ValueError(
                f"activation_row_bytes has no count for use_lora={self.use_lora}, checkpointing={self.checkpointing}"
            )

    @property
    def trainable_params(self) -> int:
        return self.lora_params if self.use_lora else self.params


def estimate_bytes(plan: MemoryPlan) -> dict[str, float]:
    """`estimate_peak` in bytes (every key but `trainable_params`)."""
    n, trained = plan.num_gpus, plan.trainable_params
    fsdp, zero2 = plan.sharding == "fsdp", plan.sharding == "zero2"
    shard = n if fsdp else 1  # FSDP2 divides the module's parameters
    state = n if (fsdp or zero2) else 1  # gradients and optimizer state
    ds_fp16 = zero2 and plan.mixed_precision == "fp16"  # DeepSpeed's fp16 engine: fp16 module, fp32 masters
    if plan.use_lora:
        module_frozen = plan.params * dtype_bytes(plan.weight_dtype) + plan.adapter_copies * plan.lora_params * 4
        weights = module_frozen / shard + plan.buffer_bytes
    else:
        weights = plan.buffer_bytes + (plan.params * 4 if plan.reference_copy else 0)  # the copy is made whole
    if fsdp and plan.largest_block_params:
        gathered = 2 if plan.mixed_precision != "fp32" else (dtype_bytes(plan.weight_dtype) if plan.use_lora else 4)
        weights += 2 * plan.largest_block_params * gathered
    trainable = trained * (2 if ds_fp16 else 4) / shard
    gradients = trained * ((2 + 4) if ds_fp16 else 4) / state  # fp16 partition + the fp32 one DeepSpeed steps on
    optimizer = trained * (8 + (4 if ds_fp16 else 0)) / state
    ema = trained * 4 / shard if plan.use_ema else 0.0
    mode = (plan.use_lora, plan.checkpointing)
    activations = plan.activation_row_bytes[mode] * plan.rows
    transient = plan.transient_bytes.get(mode, 0)
    frozen = sum(f.bytes for f in plan.frozen)
    overhead = plan.overhead_gib * GIB if plan.gpu else 0.0
    parts = dict(
        weights=weights,
        trainable=trainable,
        gradients=gradients,
        optimizer=optimizer,
        ema=ema,
        activations=activations,
        transient=transient,
        frozen=frozen,
        overhead=overhead,
    )
    parts["total"] = sum(parts.values())
    return parts


def estimate_peak(plan: MemoryPlan, **changes: Any) -> dict[str, float]:
    """The peak memory per GPU in GiB: weights, trainable, gradients, optimizer, ema, activations, transient, frozen,
    overhead and their sum `total`, plus `trainable_params` (a count). `changes` replace fields of `plan` first."""
    plan = dataclasses.replace(plan, **changes) if changes else plan
    out = {k: v / GIB for k, v in estimate_bytes(plan).items()}
    out["trainable_params"] = plan.trainable_params
    return out


def fits(total_gib: float, gpu_gib: float) -> bool:
    """Whether an estimated peak fits a GPU of `gpu_gib` GiB."""
    return total_gib <= gpu_gib


FSDP_GPUS = (2, 4, 8, 16, 32, 64)  # the GPU counts a suggestion tries for FSDP2


def _alternatives(plan: MemoryPlan, gpu_gib: float) -> dict[str, tuple[str, MemoryPlan]]:
    """The single changes to `plan` the plan has the numbers for, by kind, each as (what to do, the plan it makes).
    The micro-batch is the largest that fits (computed from the per-row count; 1 row when none does) and FSDP2 the
    smallest GPU count of FSDP_GPUS that fits (the largest when none does)."""
    out: dict[str, tuple[str, MemoryPlan]] = {}
    if not plan.checkpointing and (plan.use_lora, True) in plan.activation_row_bytes:
        what = "enable gradient checkpointing (model.use_gradient_checkpointing: true)"
        out["checkpointing"] = (what, dataclasses.replace(plan, checkpointing=True))
    if not plan.use_lora and plan.lora_params > 0 and (True, plan.checkpointing) in plan.activation_row_bytes:
        what = f"train LoRA ({plan.lora_params / 1e6:.1f} M parameters) instead of the full model (model.use_lora: true)"
        out["lora"] = (what, dataclasses.replace(plan, use_lora=True, reference_copy=False))
    offloadable = [f for f in plan.frozen if f.offloadable and not f.offloaded]
    if offloadable:
        frozen = tuple(dataclasses.replace(f, offloaded=True) if f in offloadable else f for f in plan.frozen)
        what = "offload the text encoders to the CPU (model.offload_text_encoders: true)"
        out["offload"] = (what, dataclasses.replace(plan, frozen=frozen))
    if plan.rows > 1:
        row = plan.activation_row_bytes[(plan.use_lora, plan.checkpointing)]
        rest = estimate_bytes(plan)["total"] - row * plan.rows
        rows = max(1, min(plan.rows - 1, int((gpu_gib * GIB - rest) // row) if row else plan.rows - 1))
        what = (
            f"a smaller micro-batch: {rows} rows instead of {plan.rows} (train.num_minibatches x {math.ceil(plan.rows / rows)})"
        )
        out["rows"] = (what, dataclasses.replace(plan, rows=rows))
    more = [n for n in FSDP_GPUS if n > (plan.num_gpus if plan.sharding == "fsdp" else 1)]
    if more:
        sharded = [dataclasses.replace(plan, sharding="fsdp", num_gpus=n) for n in more]
        best = next((p for p in sharded if fits(estimate_peak(p)["total"], gpu_gib)), sharded[-1])
        out["fsdp"] = (f"shard with FSDP2 over {best.num_gpus} GPUs (configs/accelerate/fsdp.yaml)", best)
    return out


def suggestion(plan: MemoryPlan, gpu_gib: float) -> str:
    """ "" when the plan fits `gpu_gib`; else which single changes (gradient checkpointing, LoRA instead of full
    fine-tuning, offloading the text encoders, the largest micro-batch that fits, FSDP2 over the fewest GPUs that fit)
    bring it under, each with the total it makes. When none does alone, they are combined in that order (the ones
    that cost no GPUs and little speed first), each change kept only while the plan does not yet fit."""
    total = estimate_peak(plan)["total"]
    if fits(total, gpu_gib):
        return ""
    head = f"estimated {total:.1f} GiB per GPU does not fit {gpu_gib:g} GiB"
    single = [(what, estimate_peak(p)["total"]) for what, p in _alternatives(plan, gpu_gib).values()]
    under = [f"{what} ({t:.1f} GiB)" for what, t in single if fits(t, gpu_gib)]
    if under:
        return f"{head}; each of these brings it under: " + "; ".join(under)
    combined, steps = plan, []
    for kind in ("checkpointing", "lora", "offload", "rows", "fsdp"):
        alternatives = _alternatives(combined, gpu_gib)
        if kind == "rows":  # then the micro-batch or FSDP2, either of them alone if that is enough
            enough = [alternatives[k] for k in ("rows", "fsdp") if k in alternatives]
            enough = [(what, t) for what, p in enough if fits(t := estimate_peak(p)["total"], gpu_gib)]
            if steps and enough:
                either = " or ".join(f"{what} ({t:.1f} GiB)" for what, t in enough)
                return f"{head}; no single change brings it under, together these do: " + "; ".join(steps) + f"; then {either}"
        change = alternatives.get(kind)
        if change is None or estimate_peak(change[1])["total"] >= estimate_peak(combined)["total"]:
            continue
        steps.append(change[0])
        combined = change[1]
        total = estimate_peak(combined)["total"]
        if fits(total, gpu_gib):
            return f"{head}; no single change brings it under, together these do: " + "; ".join(steps) + f" ({total:.1f} GiB)"
    return f"{head}, even with every change the estimate knows ({estimate_peak(combined)['total']:.1f} GiB)"


# ------------------------------------------------------------------------------------------ the measurement


class _LiveStorages(TorchDispatchMode):
    """Live bytes of tensor storage: every storage an operator outputs is added once with its size and a weak
    reference whose callback subtracts it when freed; the peak is taken after each operator."""

    def __init__(self, meta: bool = False):
        super().__init__()
        self.meta = meta  # track meta tensors' storages too (sizes without memory: for counting on meta)
        self.sizes: dict[int, tuple[int, weakref.ref]] = {}
        self.now = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        entry = self.sizes.pop(key, None)
        if entry is not None:
            self.now -= entry[0]

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" and not self.meta:
            return
        s = _storage(t)
        if s is None:
            return
        key, size = id(s), s.nbytes()
        entry = self.sizes.get(key)
        if entry is None:
            self.sizes[key] = (size, weakref.ref(s, lambda _, key=key: self._freed(key)))
            self.now += size
        elif entry[0] != size:  # resized in place
            self.now += size - entry[0]
            self.sizes[key] = (size, entry[1])
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def measure_peak(fn: Callable[[], Any], alive: Iterable[Any] | None = None) -> int:
    """Peak bytes of live tensor storage while `fn()` runs on the CPU, including the storages alive before: those of
    `alive` (modules, optimizers, tensors, containers of them: see `tensors_of`), or, when None, every tensor the
    garbage collector finds in the process."""
    tracker = _LiveStorages()
    before = tensors_of(list(alive)) if alive is not None else (o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    for t in before:
        tracker.add(t)
    del before
    try:
        with tracker:
            fn()
    finally:
        peak = tracker.peak
        tracker.sizes.clear()
    return peak
