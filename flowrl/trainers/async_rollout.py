"""Asynchronous rollouts for DiffusionNFT (`train.async_rollout`), as Miles-Diffusion's one-rollout overlap: the rollout
of step k + 1 is made while step k trains, one step stale. The math is in docs/math.md#asynchronous-nft.

    step k:   take batch k (sampled by θ_old as it stood at the start of step k − 1)
              snapshot θ_old → the "rollout" adapter; a worker thread rolls out and scores batch k + 1 with it
              train on batch k (the loss uses the current θ_old), soft-update θ_old

The worker runs a copy of the transformer (its own adapters, so the trained module's active adapter never switches
under it) in one thread of this process, on its own CUDA stream on a GPU. The "rollout" adapter is saved with the run:
a resumed run rolls its first batch out again from it, as the uninterrupted run did. With `async_staleness: 0` each
step launches its own rollout from the current θ_old and waits for it: the synchronous recipe, through the same code.
A batch's work (rollout, score) is counted by the worker into its own meter and billed to the step that trains on it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time

import torch

import flowrl.trainers.kit as kit
from flowrl import work
from flowrl.training.clock import timed
from flowrl.training.scoring import Scorer

ROLLOUT = "rollout"  # the adapter a prefetched batch is sampled with (a snapshot of θ_old)


def check_async(parts) -> None:
    """One-line errors for the runs an asynchronous rollout cannot serve; a no-op with it off."""
    t = parts.cfg.train
    if t.async_staleness not in (0, 1):
        raise ValueError(f"train.async_staleness={t.async_staleness} must be 0 (synchronous) or 1 (one step stale)")
    if not t.async_rollout:
        return
    if t.replay.enabled:
        raise ValueError("train.async_rollout and train.replay.enabled: enable one of them")
    if parts.accelerator.num_processes > 1:
        raise ValueError(
            "train.async_rollout gathers the prefetched batch's scores in a worker thread, beside the training "
            "thread's collectives: run one process, or set train.async_rollout=false"
        )


def rollout_copy(model):
    """A FlowModel that shares everything with `model` but its transformer (a deep copy with the same adapters)."""
    twin = copy.copy(model)
    twin.transformer = copy.deepcopy(model.transformer).requires_grad_(False)
    pipe = getattr(model, "pipe", None)
    if pipe is not None and getattr(pipe, "transformer", None) is model.transformer:
        twin.pipe = copy.copy(pipe)
        twin.pipe.transformer = twin.transformer
    return twin


class RolloutAhead:
    """The next step's rollout, made in a worker thread while this step trains (`next(step)` -> kit.Experience)."""

    def __init__(self, parts, adapter: str, staleness: int) -> None:
        self.parts, self.adapter, self.staleness = parts, adapter, staleness
        self._twin = None  # the rollout copy, made at the first launch (after a resume restored the adapters)
        self._thread: threading.Thread | None = None
        self._out: dict = {}
        self._paused_cpu: float | None = None  # the worker's CPU clock when the last step ended
        device = parts.accelerator.device
        self._stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None

    def _snapshot(self) -> None:
        """The "rollout" adapter <- θ_old (the sampling policy as it stands now)."""
        self.parts.model.copy_adapter(self.adapter, ROLLOUT)

    def _launch(self, step: int, version: int) -> None:
        parts = self.parts
        if self._twin is None:
            self._twin = rollout_copy(parts.model)
        live = parts.model.adapter_parameters(ROLLOUT)
        with torch.no_grad():
            for name, p in self._twin.adapter_parameters(ROLLOUT).items():
                p.copy_(live[name])
        scorer = Scorer(parts.scorer.rewards, parts.scorer.policy, use_async=False)  # scores in the worker thread
        view = dataclasses.replace(parts, model=self._twin, step=step, scorer=scorer, counters={"reward_errors": 0})
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(parts.accelerator.device))  # the adapter copy first
        self._out = {"step": step, "version": version}
        self._thread = threading.Thread(target=self._work, args=(view,), daemon=True)
        self._thread.start()

    def _work(self, view) -> None:
        meter = work.Meter()
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with work.redirected(meter), stream:
                self._out["exp"] = kit.collect(view, adapter=ROLLOUT)
        except BaseException as error:  # raised again in the training thread
            self._out["error"] = error
        self._out["work"], self._out["errors"] = meter.metrics(), view.counters["reward_errors"]
        self._out["cpu_end"] = time.thread_time()

    def _worker_cpu(self) -> float:
        """The worker thread's CPU seconds so far (all of them once it has ended)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (OSError, AttributeError):  # it has ended: its own last reading
            self._thread.join()
            return self._out["cpu_end"]

    def pause(self) -> None:
        """At the end of a step: note the worker's CPU clock, so that the CPU it spends until the next step (beside an
        evaluation or a checkpoint) is billed to that step as `perf/offline_cpu_s` (the race's CPU clock reads the
        process's CPU time inside steps only)."""
        self._paused_cpu = self._worker_cpu() if self._thread is not None else None

    def _take(self, step: int):
        tic = timed(self.parts.accelerator.device)
        between = self._worker_cpu() - self._paused_cpu if self._paused_cpu is not None else 0.0
        self._paused_cpu = None
        self._thread.join()
        self._thread = None
        if self._stream is not None:
            torch.cuda.current_stream(self.parts.accelerator.device).wait_stream(self._stream)
        out = self._out
        if "error" in out:
            raise out["error"]
        if out["step"] != step:
            raise RuntimeError(f"the prefetched rollout is of step {out['step']}, not of step {step}")
        work.METER.merge(out["work"])  # the batch's rollout and score work, billed to the step that trains on it
        self.parts.counters["reward_errors"] += out["errors"]
        exp = out["exp"]
        exp.metrics |= {"train/staleness": float(step - out["version"]), "perf/rollout_wait_s": tic.seconds()}
        exp.metrics["perf/offline_cpu_s"] = between  # the worker's CPU between the previous step and this one
        exp.started = timed(self.parts.accelerator.device)  # the step's wall time starts when it has its batch
        return exp

    def next(self, step: int):
        """Batch `step`: with staleness 0 rolled out now from the current θ_old; with staleness 1 the one launched at
        the previous step (or, at a run's first step and after a resume, launched now from the "rollout" adapter),
        and batch step + 1 launched from the current θ_old before this step trains."""
        if self.staleness == 0:
            self._snapshot()
            self._launch(step, step)
            return self._take(step)
        if self._thread is None:
            self._launch(step, max(step - 1, 0))  # the "rollout" adapter: θ_old of the step before (saved)
        exp = self._take(step)
        self._snapshot()
        if step + 1 < self.parts.cfg.num_steps:
            self._launch(step + 1, step)
        return exp

    def close(self) -> None:
        """Wait for a rollout still in flight (its batch is dropped)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
