"""The work meter: what one training step makes the hardware do, counted where the work happens.

Two layers report into one process-wide meter (`METER`), so a recipe, a sampler or a reward never counts anything
itself:

- the model adapter layer: a forward hook on every transformer a FlowModel runs (`meter_transformer`: the policy, a
  second expert, a preview copy) counts the rows that pass through it (classifier-free guidance's doubled batch is
  two rows), whether autograd recorded them, the backend they ran at (`policy`; `preview` for the policy's forwards
  in a candidate pool's cheap pass; a quantized preview copy's tag such as `fp8`, `fake_nvfp4`, `fake_nvfp4+cached`),
  and, when a gradient reaches the output, the rows of the backward (`lora` when only LoRA weights train, else
  `full`) and of the forward that activation checkpointing recomputes; `decoded` counts decoded samples (a video is
  one) and their pixels, and `encoded` the prompts through the text encoders and their tokens;
- the reward layer (flowrl.training.scoring's `MeteredReward`): images per reward, and the backward through a reward
  where a recipe takes its gradient.

Counts are grouped by phase: `rollout` (stages 1-2), `score` (rewards, in whatever thread scores them) and `train`
(the rest of a step). `flowrl.training.loop.metered_step` resets the meter before a step and reads it after; the
metrics are `work/<phase>/<kind>/<detail>` (docs/cost.md lists the kinds), summed over processes, and
flowrl.plan.cost prices them at a real architecture's size.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import torch

PHASES = ("rollout", "score", "train")
KINDS = (
    "forward",
    "forward_grad",
    "backward",
    "recompute",
    "decode",
    "decode_backward",
    "encode",
    "reward",
    "reward_backward",
)


class Meter:
    """Counts by (phase, kind, detail); thread-safe (rewards may score in a worker thread). The phase and the previews
    flag are per thread, and a thread may send its counts to another meter (`redirected`: an asynchronous rollout's
    work, billed to the step that trains on it)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], float] = defaultdict(float)
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def phase(self) -> str:
        return getattr(self._local, "phase", "train")

    @phase.setter
    def phase(self, name: str) -> None:
        self._local.phase = name

    @property
    def previewing(self) -> bool:
        return getattr(self._local, "previewing", False)

    @previewing.setter
    def previewing(self, value: bool) -> None:
        self._local.previewing = value

    def add(self, kind: str, detail: str, amount: float, phase: str | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"work kind {kind!r} is not one of {', '.join(KINDS)}")
        target = getattr(self._local, "redirect", None) or self
        with target._lock:
            target._counts[(phase or self.phase, kind, detail)] += float(amount)

    def merge(self, counts: dict[str, float]) -> None:
        """Add `metrics()` of another meter to this one."""
        for key, value in counts.items():
            phase, kind, detail = key.split("/", 3)[1:]
            self.add(kind, detail, value, phase)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self.phase = "train"
            self.previewing = False

    def metrics(self) -> dict[str, float]:
        """{"work/<phase>/<kind>/<detail>": count} of everything counted since the last reset."""
        with self._lock:
            return {f"work/{p}/{k}/{d}": v for (p, k, d), v in sorted(self._counts.items())}


METER = Meter()


@contextlib.contextmanager
def phase(name: str):
    """Count the work inside the block under phase `name` (rollout, score, train)."""
    if name not in PHASES:
        raise ValueError(f"work phase {name!r} is not one of {', '.join(PHASES)}")
    before, METER.phase = METER.phase, name
    try:
        yield
    finally:
        METER.phase = before


@contextlib.contextmanager
def redirected(meter: Meter):
    """This thread's counts inside the block go to `meter` instead of METER."""
    before, METER._local.redirect = getattr(METER._local, "redirect", None), meter
    try:
        yield
    finally:
        METER._local.redirect = before


@contextlib.contextmanager
def previews():
    """The policy's forwards inside the block are previews (a candidate pool's cheap pass: `preview`); a quantized
    preview copy keeps its own tag."""
    before, METER.previewing = METER.previewing, True
    try:
        yield
    finally:
        METER.previewing = before


def backend_of(module: torch.nn.Module) -> str:
    """The backend a transformer runs at: a preview copy is tagged by flowrl.quant (`flowrl_backend`, e.g. `fp8`,
    `fake_nvfp4+cached`); the policy inside `previews()` is `preview`; else `policy`."""
    tag = getattr(module, "flowrl_backend", None)
    return tag if tag else ("preview" if METER.previewing else "policy")


def _trains_fully(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for name, p in module.named_parameters() if "lora_" not in name)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_tensor, value.values()) if t is not None), None)
    sample = getattr(value, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


def _count_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
    x = kwargs.get("hidden_states", args[0] if args else None)
    x = _first_tensor(x)
    if x is None:
        return
    rows, backend = int(x.shape[0]), backend_of(module)
    METER.add("forward", backend, rows)
    out = _first_tensor(output)
    if out is None or not out.requires_grad:
        return
    METER.add("forward_grad", backend, rows)
    kind = "full" if _trains_fully(module) else "lora"
    recompute = bool(getattr(module, "is_gradient_checkpointing", getattr(module, "gradient_checkpointing", False)))
    where = METER.phase

    def on_backward(grad):
        METER.add("backward", kind, rows, where)
        if recompute:
            METER.add("recompute", backend, rows, where)

    out.register_hook(on_backward)


def meter_transformer(module: torch.nn.Module | None) -> None:
    """Count every forward (and backward) of `module`; idempotent, and a deep copy (a preview) keeps the hook."""
    if module is None or not isinstance(module, torch.nn.Module):
        return
    if any(getattr(h, "__name__", "") == _count_forward.__name__ for h in module._forward_hooks.values()):
        return
    module.register_forward_hook(_count_forward, with_kwargs=True)


def decoded(images: torch.Tensor) -> torch.Tensor:
    """Count a decode's output, images [N, 3, H, W] or videos [N, 3, F, H, W] (`decode/images`: N samples, a video is
    one; `decode/pixels`: every frame's pixels), and its backward where a gradient flows through it; returns
    `images`."""
    count, pixels = images.shape[0], images.numel() // images.shape[1]
    METER.add("decode", "images", count)
    METER.add("decode", "pixels", pixels)
    if images.requires_grad:
        where = METER.phase
        images.register_hook(lambda grad: METER.add("decode_backward", "images", count, where))
    return images


def encoded(prompts: int, tokens: int) -> None:
    """Count `prompts` text-encoder rows (a negative prompt is a row) of `tokens` tokens in all."""
    METER.add("encode", "prompts", prompts)
    METER.add("encode", "tokens", tokens)


def scored(name: str, images: torch.Tensor, output) -> None:
    """Count `images` scored by reward `name` (phase `score`), and the backward through it where one runs."""
    METER.add("reward", name, images.shape[0], "score")
    scores = getattr(output, "scores", None)
    if images.requires_grad and isinstance(scores, torch.Tensor) and scores.requires_grad:
        n = images.shape[0]
        scores.register_hook(lambda grad: METER.add("reward_backward", name, n, "score"))
