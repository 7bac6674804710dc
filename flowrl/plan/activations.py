"""What autograd keeps of a forward, counted (on the meta device or the CPU), and the peak of live tensor storage,
measured: the two halves of flowrl.plan.memory's check.

    count = count_activations(meta_transformer, make_inputs, rows=8, checkpointing=True, working=True)
    peak = measure_peak(step, alive=[transformer, optimizer])  # bytes: what an estimate is checked against

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
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def with_lora(
    module: torch.nn.Module, rank: int, targets: Iterable[str], alpha: float | None = None
) -> torch.nn.Module:
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
    before = (
        tensors_of(list(alive)) if alive is not None else (o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    )
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
