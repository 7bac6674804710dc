"""The run loop every recipe's `train()` is, the stage clocks and the per-step metrics every recipe logs."""

from __future__ import annotations

import time

import torch


def progress_bar(enabled: bool, total: int, initial: int, desc: str):
    """A tqdm bar on the main process (None elsewhere or when disabled)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def show_progress(bar, metrics: dict) -> None:
    if bar is None:
        return
    bar.update(1)
    shown = {
        k.split("/")[-2] if k.startswith("reward/") else k.split("/")[-1]: f"{v:.3g}"
        for k, v in metrics.items()
        if (k.endswith("/mean") and k.startswith("reward/")) or k == "train/loss"
    }
    bar.set_postfix(shown)


class Clock:
    """Wall seconds since it started, for the `perf/...` timings. On CUDA it synchronises the device when it starts and
    when read: kernels run asynchronously, so without it a stage's queued work is billed to whichever later stage first
    waits on the device (docs/models.md#timings)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._synchronize()
        self.started = time.perf_counter()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self) -> float:
        self._synchronize()
        return time.perf_counter() - self.started


def timed(device: str | torch.device) -> Clock:
    """A started `Clock` on `device`: `tic = timed(acc.device)` ... `rollout_s = tic.seconds()`."""
    return Clock(device)


def step_metrics(wall: float, rollout_s: float, reward_s: float, optimise_s: float, num_samples: int, errors: int, kept) -> dict:
    """The `perf/...` timings and sample counts every recipe logs for one step (`num_samples` over all processes)."""
    return {
        "perf/step_s": wall,
        "perf/rollout_s": rollout_s,
        "perf/reward_s": reward_s,
        "perf/optimise_s": optimise_s,
        "perf/samples_per_s": num_samples / wall,
        "train/reward_errors": float(errors),
        "train/kept_samples": float(kept),
    }


def train_loop(recipe, label: str) -> dict:
    """Run a recipe to cfg.num_steps: resume (checkpoint.resume), the run folder and trackers, the base eval, then
    `recipe.train_step()` with logging, evals and checkpoints on their cadences, a last checkpoint and eval.

    The recipe provides cfg, accelerator, run, step, train_step(), save(), resume(path), evaluate(step | None)
    and (if it scores through one) scorer; every recipe's `train()` is this loop (the algorithm lives in its train_step)."""
    from flowrl.config import dump_config, flatten, to_dict
    from flowrl.training.checkpoint import resolve_resume

    cfg, acc = recipe.cfg, recipe.accelerator
    resume = resolve_resume(cfg.checkpoint.resume, recipe.run.root)
    if resume is not None:
        recipe.resume(resume)
    recipe.run.start(acc, dump_config(cfg), recipe.opt.sharding.kind, cfg.model.mixed_precision)
    scalars = {k: v for k, v in flatten(to_dict(cfg)).items() if isinstance(v, (int, float, str, bool))}
    acc.init_trackers(cfg.name, config=scalars)
    if recipe.step == 0:
        recipe.evaluate(None)
    bar = progress_bar(cfg.logging.progress_bar and acc.is_main_process, cfg.num_steps, recipe.step, f"{label} {cfg.name}")
    history = []
    while recipe.step < cfg.num_steps:
        metrics = recipe.train_step()
        history.append(metrics)
        recipe.run.log(acc, recipe.step, metrics)
        show_progress(bar, metrics)
        step, last = recipe.step, recipe.step >= cfg.num_steps
        if cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0 and not last:
            recipe.save()
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0 and not last:
            recipe.evaluate(step)
    if bar is not None:
        bar.close()
    recipe.save()
    final = recipe.evaluate(recipe.step)
    if getattr(recipe, "scorer", None) is not None:  # adjoint matching scores in its own step (with a gradient)
        recipe.scorer.close()
    acc.wait_for_everyone()
    acc.end_training()
    return {"history": history, "final_eval": final}
