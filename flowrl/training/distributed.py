"""Processes and sharding: the run's accelerator, FSDP2 / DeepSpeed ZeRO-2 preparation, full-state gather.

Two ways to spread a run over processes, chosen by the accelerate config the run is launched with:

- **Data parallel** (`multi_gpu.yaml`, `cpu_2proc.yaml`, one process): every process holds the whole trained
  module; the trainer averages gradients itself, one all-reduce per optimizer step.
- **Sharded** (`fsdp.yaml`: FSDP2, `deepspeed_zero2.yaml`: ZeRO-2): `Sharding.prepare` hands the module and the
  optimizer to accelerate. FSDP2 shards parameters, gradients and optimizer state and reduces gradients in
  each backward; ZeRO-2 shards gradients and optimizer state, and owns the optimizer step and clipping.

Checkpoints hold the *full* state in one layout whatever the sharding (tensors keyed by parameter name,
optimizer moments per parameter), so a run saved under FSDP can resume data-parallel and the other way.

accelerate enters FSDP or DeepSpeed only on accelerator devices. On a CPU-only machine (`device: cpu`, the
tests) `make_accelerator` runs them over gloo: DeepSpeed through its CPU accelerator, FSDP2 on a CPU device
mesh (accelerate's state is told it is FSDP, which its CPU path cannot say itself).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def make_accelerator(cfg):
    """The accelerator for a run config: precision, trackers, project folder, the process-group timeout
    (`distributed_timeout_s`), and the launch's sharding."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    trackers = [tr for tr in cfg.logging.trackers if tr != "wandb" or _installed("wandb")]
    # flowrl runs autocast inside the model's velocity and scales fp16 losses itself (flowrl.training.optim), so
    # accelerate's own mixed precision is only handed to the sharded engines: FSDP2 casts for compute (and reduces in
    # float32, Sharding.prepare), DeepSpeed scales fp16 losses. DeepSpeed's bf16 mode would cast the whole module, the
    # trained LoRA and NFT's old adapter with it (and so the EMA), to bf16: under bf16 its engine stays float32
    precision = {"fp32": "no"}.get(cfg.model.mixed_precision, cfg.model.mixed_precision)
    if not (_env_flag("ACCELERATE_USE_FSDP") or (_env_flag("ACCELERATE_USE_DEEPSPEED") and precision == "fp16")):
        precision = "no"
    kwargs = dict(
        mixed_precision=precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir / "logs")),
    )
    cpu = cfg.device == "cpu"
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    timeout = timedelta(seconds=cfg.distributed_timeout_s)
    if cpu and launched and _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)], **kwargs)
    acc = Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)], **kwargs)
    if cpu and launched and _env_flag("ACCELERATE_USE_FSDP"):
        _fsdp_on_cpu(acc)
    return acc


def _fsdp_on_cpu(acc) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` set
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective for a sharded DTensor: every process must call it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().contiguous()


def kept_per_process(acc, kept) -> float:
    """The mean over processes of a local count of kept samples (1 where none is kept anywhere). Each process divides
    its summed loss by it and the gradients are averaged over processes, so the result is the mean over every
    process's kept samples however unevenly a sample mask (gd2po's) falls between them; dividing by the local count
    instead weights a process's samples by how few of them it kept. A collective: every process must call it."""
    value = float(kept)
    if acc.num_processes > 1:
        value = float(acc.reduce(torch.tensor([value], device=acc.device), reduction="mean"))
    return value if value > 0 else 1.0


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor) laid out as `ref`: sharded the same way when `ref` is a DTensor."""
    value = value.to(device=ref.device, dtype=ref.dtype)
    if hasattr(ref, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, ref.device_mesh, ref.placements)
    return value


class Sharding:
    """The trained module's sharding: `kind` is None (data parallel), "fsdp" or "deepspeed"."""

    def __init__(self, accelerator):
        self.acc = accelerator
        kind = accelerator.distributed_type.name if accelerator.num_processes > 1 else ""
        self.kind = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(kind)
        self.engine = None
        if self.kind == "fsdp" and not accelerator.is_fsdp2:
            raise ValueError(
                "FSDP version 1 is not supported: set fsdp_config.fsdp_version: 2 in the accelerate config "
                "(configs/accelerate/fsdp.yaml)"
            )
        if self.kind == "deepspeed":
            stage = accelerator.state.deepspeed_plugin.zero_stage
            if stage not in (0, 1, 2):
                raise ValueError(
                    f"DeepSpeed zero_stage={stage} is not supported: use ZeRO-2 "
                    "(configs/accelerate/deepspeed_zero2.yaml); ZeRO-3 would shard the weights the "
                    "sampler reads outside the engine"
                )

    def prepare(self, module: torch.nn.Module, optimizer, micro_batch: int, max_grad_norm: float):
        """Hand module and optimizer to accelerate; returns the optimizer (FSDP2 shards `module` in place).

        Under DeepSpeed the module is not replaced: flowrl calls it directly (ZeRO-2 keeps whole weights on
        every process and reduces gradients through hooks on the parameters), and `backward` marks which
        backward call ends an optimizer step, so the engine's own accumulation count stays 1.
        """
        if self.kind is None:
            return optimizer
        if self.kind == "deepspeed":
            config = self.acc.state.deepspeed_plugin.deepspeed_config
            config.update(
                train_micro_batch_size_per_gpu=micro_batch,
                gradient_accumulation_steps=1,
                train_batch_size=micro_batch * self.acc.num_processes,
                gradient_clipping=max_grad_norm,
            )
            self.engine, optimizer = self.acc.prepare(module, optimizer)
            return optimizer
        if (
            self.acc.mixed_precision != "no"
        ):  # parameters gathered in bf16/fp16 for compute, gradients reduced in float32
            from torch.distributed.fsdp import MixedPrecisionPolicy

            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[self.acc.mixed_precision]
            self.acc.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32
            )
        _, optimizer = self.acc.prepare(module, optimizer)
        return optimizer

    # -------------------------------------------------------------------------------------- gradients
    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """One backward; under DeepSpeed the engine steps (clip, optimizer, zero grad) at the boundary."""
        if self.kind != "deepspeed":
            loss.backward()
            return
        self.engine.set_gradient_accumulation_boundary(is_boundary=boundary)
        self.engine.backward(loss)
        if boundary:
            self.engine.step()

    def all_true(self, flag: bool) -> bool:
        """True only when `flag` is true on every process (one small all-reduce)."""
        if self.acc.num_processes == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.acc.device)
        return bool(self.acc.reduce(value, reduction="sum") == self.acc.num_processes)

    def grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm() if self.engine is not None else None
        return float(norm) if norm is not None else 0.0

    # -------------------------------------------------------------------------------------- full state
    def full_parameters(self, names: list[str], params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.kind == "deepspeed":
            from deepspeed.utils import safe_get_full_fp32_param

            return {n: safe_get_full_fp32_param(p).detach().cpu().contiguous() for n, p in zip(names, params)}
        return {n: full(p) for n, p in zip(names, params)}

    def load_parameters(self, names: list[str], params: list[torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(names, params):
                p.copy_(like(values[name], p))
                if self.kind == "deepspeed":
                    from deepspeed.utils import safe_set_full_fp32_param

                    safe_set_full_fp32_param(p, values[name].to(p.device, torch.float32))

    def optimizer_state(self, optimizer, names: list[str], params: list[torch.Tensor], steps: int) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name: {"state": {name: {key: tensor}}, "param_groups": [...]}."""
        if self.kind == "deepspeed":
            from deepspeed.utils import safe_get_full_optimizer_state

            state = {}
            for name, p in zip(names, params):
                moments = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
                if all(v is not None for v in moments.values()):
                    state[name] = {
                        "step": torch.tensor(float(steps)),
                        **{k: v.detach().cpu() for k, v in moments.items()},
                    }
            groups = [
                {k: v for k, v in g.items() if k != "params"} | {"params": list(names)}
                for g in optimizer.param_groups[:1]
            ]
            return {"state": state, "param_groups": groups}
        saved = optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"])}
        by_position = {index[id(p)]: name for name, p in zip(names, params)}
        state = {
            by_position[i]: {k: full(v) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in saved["state"].items()
        }
        groups = [{**g, "params": [by_position[i] for i in g["params"]]} for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(
        self, optimizer, names: list[str], params: list[torch.Tensor], saved: dict[str, Any]
    ) -> None:
        if self.kind == "deepspeed":
            from deepspeed.utils import safe_set_full_optimizer_state

            for name, p in zip(names, params):
                if name in saved["state"]:
                    for key in ("exp_avg", "exp_avg_sq"):
                        safe_set_full_optimizer_state(p, saved["state"][name][key].to(p.device), key)
            steps = next(iter(saved["state"].values()))["step"] if saved["state"] else None
            for s in self.engine.optimizer.optimizer.state.values():
                if steps is not None and "step" in s:
                    s["step"] = torch.as_tensor(
                        steps, dtype=s["step"].dtype if torch.is_tensor(s["step"]) else torch.float32
                    )
            for group, old in zip(optimizer.param_groups, saved["param_groups"]):
                group.update({k: v for k, v in old.items() if k != "params"})
            return
        position = {name: i for i, name in enumerate(names)}
        by_name = dict(zip(names, params))
        state = {
            position[n]: {k: like(v, by_name[n]) if torch.is_tensor(v) and v.ndim > 0 else v for k, v in s.items()}
            for n, s in saved["state"].items()
        }
        groups = [{**g, "params": [position[n] for n in g["params"]]} for g in saved["param_groups"]]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
