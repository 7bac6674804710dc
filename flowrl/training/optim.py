"""The optimizer step every recipe calls, and the EMA of the trained weights.

    opt = OptimizerStep(accelerator, model.transformer, cfg.train, micro_batch=mb, mixed_precision="fp16")
    opt.backward(loss, boundary=last_backward_of_the_step)      # as often as the recipe accumulates
    if opt.step(losses):                                        # average, unscale, check, clip, step, lr
        ema.update(opt.params, opt.optimizer_steps)

One code path for every way a run spreads (flowrl.training.distributed): data parallel (flowrl averages gradients,
one all-reduce per optimizer step), FSDP2 (gradients reduced in each backward, sharded) and DeepSpeed ZeRO-2
(the engine clips and steps inside the boundary backward). fp16 runs scale the loss (`LossScaler`): the
log-probs are means over every latent element, so at SD3 size most of dL/dv is below fp16's smallest
number and an unscaled backward trains on zeros. A non-finite loss or gradient skips the step; a scaler
overflow only lowers the scale; `max_consecutive_nan_steps` real skips in a row stop the run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flowrl.training.distributed import Sharding

EMA_MODES = ("ramp", "constant")


@dataclass
class OptimizerConfig:
    """Optimizer, schedule, clipping and EMA settings every recipe shares (recipes' configs extend it)."""

    learning_rate: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps, then constant."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off (the norm is still logged)."""
    max_consecutive_nan_steps: int = 3
    """A non-finite loss or gradient skips the optimizer step; this many in a row stops the run."""
    use_ema: bool = True
    ema_decay: float = 0.9
    ema_every_n_steps: int = 8
    """EMA update cadence in optimizer steps."""
    ema_mode: str = "ramp"
    """'ramp': decay min((1 + s) / (10 + s), ema_decay) with s = optimizer steps taken (Flow-GRPO);
    'constant': ema_decay from the first update (DanceGRPO uses 0.995)."""


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss, divide the gradients, halve on overflow, double after
    `growth_interval` good steps. The decision is global (made on reduced gradients or an all-reduced flag),
    so every process keeps the same scale under data parallel and FSDP2."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled, self.scale, self.growth_interval, self.good_steps = (
            enabled,
            init_scale if enabled else 1.0,
            growth_interval,
            0,
        )

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class OptimizerStep:
    """AdamW + warm-up schedule over the module's trainable parameters, prepared for the run's sharding."""

    def __init__(
        self,
        accelerator,
        module: torch.nn.Module,
        cfg: OptimizerConfig,
        micro_batch: int,
        mixed_precision: str = "fp32",
    ):
        self.acc, self.cfg = accelerator, cfg
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters: set model.use_lora=true or train the full model")
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.adam_weight_decay,
            eps=cfg.adam_epsilon,
        )
        warmup = max(cfg.lr_warmup_steps, 0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        # data parallel keeps the module and optimizer; FSDP2 shards both in place, ZeRO-2 wraps the optimizer
        self.sharding = Sharding(accelerator)
        self.optimizer = self.sharding.prepare(module, optimizer, micro_batch, cfg.max_grad_norm)
        self.params = [p for p in module.parameters() if p.requires_grad]
        # DeepSpeed scales fp16 losses inside its engine
        self.scaler = LossScaler(mixed_precision == "fp16" and self.sharding.kind != "deepspeed")
        self.optimizer_steps = 0
        self.nan_streak = 0
        self.last_grad_norm = 0.0
        self.counters = {"skipped_nan_steps": 0, "skipped_overflow_steps": 0}
        self._nonfinite_backward = False

    # -------------------------------------------------------------------------------------- one step
    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """One backward of an accumulated step; `boundary` marks the last one before `step`."""
        if self.sharding.kind == "deepspeed":
            # the engine steps inside the boundary backward, so a non-finite loss is caught before it: its
            # backward is replaced by a zero one (the accumulation stays aligned) and the step is counted skipped
            if not self.sharding.all_true(bool(torch.isfinite(loss))):
                self._nonfinite_backward = True
                loss = sum((p * 0).sum() for p in self.params)
        self.sharding.backward(loss * self.scaler.scale if self.scaler.enabled else loss, boundary)

    def step(self, losses: torch.Tensor) -> bool:
        """Finish an optimizer step over the accumulated gradients; `losses` are this step's loss values.

        Returns whether the weights moved. Raises FloatingPointError after `max_consecutive_nan_steps`
        non-finite steps in a row.
        """
        if self.sharding.kind == "deepspeed":  # the engine has stepped (clipped, updated, zeroed) already
            finite, self._nonfinite_backward = not self._nonfinite_backward, False
            losses_finite = finite
        else:
            self._average_gradients()
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.scaler.enabled:
                for g in grads:
                    g.mul_(1.0 / self.scaler.scale)
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this process's shard
            losses_finite = bool(torch.isfinite(losses).all())
            finite = all(bool(torch.isfinite(g).all()) for g in local) and losses_finite
            if self.sharding.kind == "fsdp":
                finite = self.sharding.all_true(finite)
                losses_finite = self.sharding.all_true(losses_finite)
            self.scaler.update(overflow=not finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.enabled and losses_finite:  # an fp16 overflow: a lower scale, not a failure
                self.counters["skipped_overflow_steps"] += 1
                return False
            self.counters["skipped_nan_steps"] += 1
            self.nan_streak += 1
            if self.nan_streak >= self.cfg.max_consecutive_nan_steps:
                raise FloatingPointError(
                    f"{self.nan_streak} optimizer steps in a row had a non-finite loss or gradient; lower "
                    "train.learning_rate or train.clip_range, or check the rewards"
                )
            if self.sharding.kind != "deepspeed":
                return False
        else:
            self.nan_streak = 0
        if self.sharding.kind == "deepspeed":
            self.last_grad_norm = self.sharding.grad_norm()
        else:
            limit = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")  # 0 = measure, no clipping
            norm = torch.nn.utils.clip_grad_norm_(self.params, limit)
            self.last_grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.optimizer_steps += 1
        return True

    def _average_gradients(self) -> None:
        """Data parallel: one all-reduce (mean) of every gradient; FSDP2 has reduced them in backward."""
        if self.sharding.kind is not None or self.acc.num_processes == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self.acc.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(p.dtype)
            offset += g.numel()

    def metrics(self) -> dict[str, float]:
        return {
            "train/grad_norm": self.last_grad_norm,
            "train/optimizer_steps": float(self.optimizer_steps),
            "train/lr": self.lr_scheduler.get_last_lr()[0],
            "train/loss_scale": self.scaler.scale,
            **{f"train/{k}": float(v) for k, v in self.counters.items()},
        }

    # -------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Counters and the loss scale (JSON); tensors are saved through `full_state`."""
        return {
            "optimizer_steps": self.optimizer_steps,
            "nan_streak": self.nan_streak,
            "counters": dict(self.counters),
            "loss_scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer_steps, self.nan_streak = int(state["optimizer_steps"]), int(state["nan_streak"])
        self.counters.update(state.get("counters", {}))
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def full_state(self, gather: bool) -> tuple[dict, dict]:
        """(trainable tensors, optimizer state) whole and keyed by name; `gather=False` returns empty dicts
        (a data-parallel process that does not write); under FSDP2 / ZeRO-2 every process must gather."""
        if not (gather or self.sharding.kind is not None):
            return {}, {}
        return (
            self.sharding.full_parameters(self.names, self.params),
            self.sharding.optimizer_state(self.optimizer, self.names, self.params, self.optimizer_steps),
        )

    def load_full_state(self, trainable: dict, optimizer_state: dict, lr_scheduler: dict) -> None:
        self.sharding.load_parameters(self.names, self.params, trainable)
        self.sharding.load_optimizer_state(self.optimizer, self.names, self.params, optimizer_state)
        self.lr_scheduler.load_state_dict(lr_scheduler)


class EMA:
    """Exponential moving average of the trained parameters, for evaluation and the exported adapter.

    Updated after the optimizer steps s = k·every_n_steps (s counts optimizer steps): ema ← d·ema + (1 − d)·θ
    with d = min((1 + s) / (10 + s), decay) in 'ramp' mode (Flow-GRPO) or d = decay in 'constant' mode.
    """

    def __init__(
        self, names: list[str], params: list[torch.Tensor], decay: float, every_n_steps: int, mode: str = "ramp"
    ):
        if mode not in EMA_MODES:
            raise ValueError(f"train.ema_mode={mode!r} must be 'ramp' or 'constant'")
        if every_n_steps < 1 or not 0.0 <= decay <= 1.0:
            raise ValueError(
                f"train.ema_every_n_steps={every_n_steps} must be >= 1 and train.ema_decay={decay} in [0, 1]"
            )
        self.names, self.decay, self.every_n_steps, self.mode = names, decay, every_n_steps, mode
        # at least float32 whatever the weights' dtype (DeepSpeed's fp16 engine holds fp16 copies)
        self.shadow = {
            n: p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for n, p in zip(names, params)
        }
        self.num_updates = 0

    def decay_at(self, optimizer_steps: int) -> float:
        if self.mode == "constant":
            return self.decay
        return min((1 + optimizer_steps) / (10 + optimizer_steps), self.decay)

    @torch.no_grad()
    def update(self, params: list[torch.Tensor], optimizer_steps: int) -> bool:
        """Call after every optimizer step; updates on the cadence and returns whether it did."""
        if optimizer_steps % self.every_n_steps:
            return False
        d = self.decay_at(optimizer_steps)
        for name, p in zip(self.names, params):
            self.shadow[name].mul_(d).add_(p.detach(), alpha=1 - d)
        self.num_updates += 1
        return True

    @contextlib.contextmanager
    def swapped(self, params: list[torch.Tensor]):
        """Context: the trained parameters temporarily replaced by their EMA (for evaluation)."""
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for name, p in zip(self.names, params):
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(params, saved):
                    p.copy_(value)
