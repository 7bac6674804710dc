"""Peak memory per GPU of a training run: activations counted from a real forward (flowrl.plan.activations), the
rest from parameter counts.

    count = count_activations(meta_transformer, make_inputs, rows=8, checkpointing=True, working=True)
    plan = MemoryPlan(params=..., lora_params=..., rows=8, checkpointing=True,
                      activation_row_bytes={(True, True): count.total / 8},
                      transient_bytes={(True, True): count.transient})
    parts = estimate_peak(plan)                   # GiB per component and "total"
    if not fits(parts["total"], 80):
        print(suggestion(plan, 80))               # the changes that bring it under, each computed

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

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
        what = (
            f"train LoRA ({plan.lora_params / 1e6:.1f} M parameters) instead of the full model (model.use_lora: true)"
        )
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
            f"a smaller micro-batch: {rows} rows instead of {plan.rows} "
            f"(train.num_minibatches x {math.ceil(plan.rows / rows)})"
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
                return (
                    f"{head}; no single change brings it under, together these do: "
                    + "; ".join(steps)
                    + f"; then {either}"
                )
        change = alternatives.get(kind)
        if change is None or estimate_peak(change[1])["total"] >= estimate_peak(combined)["total"]:
            continue
        steps.append(change[0])
        combined = change[1]
        total = estimate_peak(combined)["total"]
        if fits(total, gpu_gib):
            return (
                f"{head}; no single change brings it under, together these do: "
                + "; ".join(steps)
                + f" ({total:.1f} GiB)"
            )
    return f"{head}, even with every change the estimate knows ({estimate_peak(combined)['total']:.1f} GiB)"
