"""Per-reward gradients in a recipe's stage 6: MARBLE's balancing of them (flowrl/balancers/marble.py holds the
math) and the probe that logs their cosines with the update (docs/recipes/marble.md)."""

from __future__ import annotations

import torch

from flowrl.balancers.marble import clamp_active, combine, cosines, ema_alpha, harmonize
from flowrl.training.clock import timed
from flowrl.types import GradientBalancer

SINGLE, PROBE, EXACT, FULL = "single", "probe", "exact", "full"


class RewardGradients:
    """Per-reward gradients for a recipe's stage 6, and MARBLE's combination of them (docs/recipes/marble.md).

    Per optimizer step (a window of accumulated backward calls) the recipe calls `plan(window_rows)` first, then for
    every backward either its usual `opt.backward(loss)` (`single`) or `backward(loss_of, per_reward, kl_loss)`,
    and `finish()` before `opt.step`. The window's mode:

        full    K backward passes into per-reward gradients g_k (all-reduced over processes), α* of the min-norm QP,
                .grad = n̄ · Σ α*_k ĝ_k (+ the KL's own backward, outside the balancing)
        exact   the amortized form's fallback where a clamp is active: .grad = Σ ᾱ_k g_k (K backward passes)
        single  one backward on the recipe's loss at Σ ᾱ_k A_k (amortized steps between refreshes)
        probe   single, plus the K per-reward gradients only to log their cosine with the update (any balancer)

    `marble` is the balancer whose `needs()` holds "reward_gradients" (flowrl.types.GradientBalancer: MARBLE; None:
    only probe, when `probe` is set). α lives here and is written back to the balancer, whose advantages are then
    Σ ᾱ_k A_k. Every process computes the same α: the QP is solved on the all-reduced gradients. Needs data parallel
    (FSDP2 / ZeRO-2 own the gradients inside backward).
    """

    def __init__(
        self,
        marble: GradientBalancer | None,
        opt,
        accelerator,
        names: list[str],
        affine: bool,
        adv_clip_max: float | None,
        probe: bool,
    ):
        if marble is not None and marble.form == "amortized" and not affine:
            raise ValueError(
                "balancer marble: form='amortized' needs a loss affine in the advantage (the NFT recipe); this "
                "recipe's clipped ratio loss is not affine in the advantage, so Σ α_k ∇ℓ(A_k) ≠ ∇ℓ(Σ α_k A_k): set "
                "balancer.form=full"
            )
        if opt.sharding.kind is not None and (marble is not None or probe):
            raise ValueError(
                f"balancer marble / per-reward gradients need data parallel, not {opt.sharding.kind}: the per-reward "
                "gradients are taken outside the sharded backward; launch with multi_gpu.yaml"
            )
        self.marble, self.opt, self.acc, self.names = marble, opt, accelerator, list(names)
        self.adv_clip_max, self.probe = adv_clip_max, probe
        k = len(self.names)
        self.alpha = torch.full((k,), 1.0 / k, dtype=torch.float64)
        self.windows = 0  # optimizer windows planned so far (the refresh clock)
        self.counters = {"fallbacks": 0, "refreshes": 0}
        self.mode = SINGLE
        self._grads: torch.Tensor | None = None
        self._log: dict[str, list[float]] = {}
        self.seconds = 0.0  # time in probe-only work (not part of the algorithm), for benches to take out
        self._publish()

    # ---------------------------------------------------------------------------------- per window
    def plan(self, per_reward: torch.Tensor) -> str:
        """The coming optimizer window's mode; per_reward [K, b] are the advantages of the samples it trains."""
        if self.marble is None:
            self.mode = PROBE if self.probe else SINGLE
        elif self.marble.form == "full" or self.windows % self.marble.refresh_every == 0:
            self.mode = FULL
        else:
            clamped = float(clamp_active(per_reward.cpu(), self.alpha, self.adv_clip_max))
            if self.acc.num_processes > 1:  # every process must take the same path (the all-reduce below)
                clamped = float(self.acc.reduce(torch.tensor([clamped], device=self.acc.device), reduction="sum"))
            self.mode = EXACT if clamped > 0 else (PROBE if self.probe else SINGLE)
        self.windows += 1
        self._grads = None
        return self.mode

    @property
    def single(self) -> bool:
        """Whether the recipe runs its own backward this window (single and probe)."""
        return self.mode in (SINGLE, PROBE)

    def advantages(self, advantages: torch.Tensor, per_reward: torch.Tensor) -> torch.Tensor:
        """The advantage a single backward trains on [b]: MARBLE's Σ_k ᾱ_k A_k (per_reward [K, b]), else the
        balancer's `advantages` [b] unchanged."""
        if self.marble is None:
            return advantages
        return (self.alpha.to(per_reward)[:, None] * per_reward).sum(0)

    def backward(self, loss_of, per_reward: torch.Tensor, kl_loss: torch.Tensor | None = None, boundary: bool = False):
        """Per reward k, ∇θ loss_of(A_k) accumulated into g_k (one shared forward graph; `loss_of` maps advantages
        [b] to this backward's scalar policy loss); then the KL's own backward (`kl_loss`, None = no KL term)."""
        tic = timed(self.acc.device)
        scale = self.opt.scaler.scale if self.opt.scaler.enabled else 1.0
        params = self.opt.params
        if self._grads is None:
            self._grads = torch.zeros(len(self.names), sum(p.numel() for p in params), device=params[0].device)
        for k, row in enumerate(per_reward):
            loss = loss_of(row) * scale
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            self._grads[k] += torch.cat(
                [(g if g is not None else torch.zeros_like(p)).flatten().float() for g, p in zip(grads, params)]
            )
        if self.mode == PROBE:
            self.seconds += tic.seconds()
        if kl_loss is not None and not self.single:
            self.opt.backward(kl_loss, boundary)

    def backward_step(self, loss: torch.Tensor, loss_of, per_reward: torch.Tensor, outside, boundary: bool) -> None:
        """One backward of a recipe's stage 6: each reward's `loss_of(A_k)` and the terms `outside` the balancing (None:
        none) where this window takes per-reward gradients (full, exact, probe), then the recipe's own `loss` where it
        runs its own backward (single, probe)."""
        if self.mode != SINGLE:
            self.backward(loss_of, per_reward, outside, boundary)
        if self.single:
            self.opt.backward(loss, boundary=boundary)

    def finish(self) -> None:
        """Before `opt.step`: reduce g_k over processes, combine them into .grad (full, exact) and log the cosines."""
        if self._grads is None:
            return
        tic = timed(self.acc.device)
        grads = self._grads
        if self.acc.num_processes > 1:
            grads = self.acc.reduce(grads, reduction="mean")
        existing = self._flat_grad()  # the KL's (full, exact) or the recipe's whole update (probe)
        if self.mode == FULL:
            out = harmonize(grads)
            self._record_alpha(out.alpha)
            update = out.direction.to(grads.dtype)
        elif self.mode == EXACT:
            self.counters["fallbacks"] += 1
            update = combine(grads, self.alpha)
        else:
            update = torch.zeros_like(existing)
        if self.mode in (FULL, EXACT):
            self._add_to_grad(update)
        cos = cosines(grads, update + existing)
        for name, c in zip(self.names, cos.tolist()):
            self._log.setdefault(f"marble/cos/{name}", []).append(c)
        self._log.setdefault("marble/negative_cos_fraction", []).append(float((cos < 0).double().mean()))
        self._log.setdefault("marble/opposed", []).append(float(bool((cos < 0).any())))
        self._grads = None
        if self.mode == PROBE:
            self.seconds += tic.seconds()

    # ---------------------------------------------------------------------------------- state and logs
    def _record_alpha(self, fresh: torch.Tensor) -> None:
        if self.marble.form == "amortized":
            self.alpha = ema_alpha(self.alpha, fresh, self.marble.alpha_ema)
            self.counters["refreshes"] += 1
        else:
            self.alpha = fresh
        self._publish()

    def _publish(self) -> None:
        if self.marble is not None:
            self.marble.alpha = self.alpha.float()

    def _flat_grad(self) -> torch.Tensor:
        params = self.opt.params
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params])

    def _add_to_grad(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.opt.params:
            piece = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            p.grad = piece.clone() if p.grad is None else p.grad + piece
            offset += p.numel()

    def metrics(self) -> dict[str, float]:
        """α per reward, the mean cosine of each reward's gradient with the update, the fraction of negative
        cosines and of windows with one (over the windows that had per-reward gradients), the fallback count."""
        if self.marble is None and not self.probe:
            return {}
        out = {f"marble/alpha/{name}": float(a) for name, a in zip(self.names, self.alpha)} if self.marble else {}
        out.update({k: sum(v) / len(v) for k, v in self._log.items()})
        out.update({f"marble/{k}": float(v) for k, v in self.counters.items()})
        out["perf/reward_gradients_probe_s"] = self.seconds
        self._log, self.seconds = {}, 0.0
        return out

    def state_dict(self) -> dict:
        return {"alpha": self.alpha.tolist(), "windows": self.windows, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = torch.tensor(state["alpha"], dtype=torch.float64)
        self.windows, self.counters = int(state["windows"]), dict(state["counters"])
        self._publish()
