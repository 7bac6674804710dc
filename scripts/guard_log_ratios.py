"""The distribution of GRPO's log-ratios ℓ_θ − ℓ_old with and without GRPO-Guard on the Shapes world.

Flow-GRPO's log-ratio of a transition is mean(ξ ⊙ Δμ)/s − b with b = mean(Δμ²)/(2s²)
(docs/recipes/grpo.md#grpo-guard-trainguard-true): centred at −b < 0 where the weights moved since the rollout.
GRPO-Guard's RatioNorm, (ℓ_θ − ℓ_old + b)·s, is centred at 0. This trains configs/toy/grpo_two_updates.yaml (PPO's
clip) and configs/toy/grpo_guard.yaml (the same run with the guard) for a few steps each and keeps every log-ratio of
the second optimizer step of each rollout (the first one's ratio is exactly 1), at the race's settings and at a
stressed setting (larger learning rate, four optimizer steps a rollout) where the policy moves further between the
rollout and the update.

    python scripts/guard_log_ratios.py --json docs/results/guard_log_ratio.json [--steps 10]

Writes the JSON (per run: mean, std, mean/std, quantiles, the fraction outside the clip range, b, a histogram) and a
figure beside it (.png). The shift relative to the spread is √(b·D/2) for D latent elements, so at equal b a larger
latent shows it more: the JSON also gives D.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

import flowrl.trainers.grpo as grpo_module
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.guard import RatioControl

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"clip": "configs/toy/grpo_two_updates.yaml", "guard": "configs/toy/grpo_guard.yaml"}
SETTINGS = {
    "race": [],
    "stressed": ["train.learning_rate=3e-2", "train.num_minibatches=4", "train.num_rollout_batches=4"],
}
SINK: dict[str, list[torch.Tensor]] = defaultdict(list)


class RecordingControl(RatioControl):
    """GRPO's ratio control, keeping the log-ratios of the minibatches after each step's first optimizer step."""

    def record(self, stats: dict[str, torch.Tensor]) -> None:
        super().record(stats)
        if self.fresh:
            return
        SINK["log_ratio"].append(stats["log_ratio"] if "log_ratio" in stats else torch.log(stats["ratio"]).float())
        SINK["clipped"].append(stats["clipped"].float())
        if "guard_log_ratio" in stats:
            SINK["guard_log_ratio"].append(stats["guard_log_ratio"].float())
            SINK["mean_bias"].append(stats["mean_bias"].float())


def summary(values: torch.Tensor, bins: int = 41) -> dict:
    v = values.double()
    mean, std = float(v.mean()), float(v.std(correction=0))
    q = torch.quantile(v, torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99], dtype=torch.float64)).tolist()
    lo, hi = q[0], q[-1]  # the histogram spans the 1-99% quantiles; the tails are counted apart
    edges = torch.linspace(lo, hi, bins + 1)
    counts = torch.histc(v.float(), bins=bins, min=lo, max=hi).long().tolist()
    return {
        "n": len(v),
        "mean": mean,
        "std": std,
        "mean_over_std": mean / std if std > 0 else None,
        "fraction_negative": float((v < 0).double().mean()),
        "quantiles_1_25_50_75_99": q,
        "histogram": {
            "edges": [round(float(e), 9) for e in edges],
            "counts": counts,
            "below": int((v < lo).sum()),
            "above": int((v > hi).sum()),
        },
    }


def run(config: str, overrides: list[str], steps: int, out_dir: Path) -> dict:
    SINK.clear()
    sets = [
        f"num_steps={steps}",
        f"output_dir={out_dir}",
        "logging.progress_bar=false",
        "checkpoint.every_n_steps=1000",
    ]
    cfg = load_config(ROOT / config, sets + overrides)
    trainer = build_trainer(cfg)
    latent = trainer.parts.model.latent_shape(cfg.sampler.kwargs["height"], cfg.sampler.kwargs["width"])
    tic = time.process_time()
    while trainer.parts.step < steps:
        trainer.train_step()  # the recipe's step alone: no evaluation, no checkpoint
    result = {
        "config": config,
        "overrides": overrides,
        "steps": steps,
        "clip_range": cfg.train.clip_range,
        "latent_elements": math.prod(latent),
        "cpu_seconds": round(time.process_time() - tic, 1),
        "clip_fraction": float(torch.cat(SINK["clipped"]).mean()),
        "log_ratio": summary(torch.cat(SINK["log_ratio"])),
    }
    if SINK["guard_log_ratio"]:
        result["guard_log_ratio"] = summary(torch.cat(SINK["guard_log_ratio"]))
        result["mean_bias"] = float(torch.cat(SINK["mean_bias"]).double().mean())
    return result


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("clip", "log_ratio", "PPO clip: ℓ_θ − ℓ_old"), ("guard", "log_ratio", "guard run: ℓ_θ − ℓ_old")]
    panels.append(("guard", "guard_log_ratio", "guard run: RatioNorm log ρ"))
    fig, axes = plt.subplots(len(SETTINGS), len(panels), figsize=(4.2 * len(panels), 3.2 * len(SETTINGS)))
    for r, setting in enumerate(SETTINGS):
        for c, (name, key, title) in enumerate(panels):
            ax, s = axes[r][c], data["runs"][setting][name][key]
            edges, counts = s["histogram"]["edges"], s["histogram"]["counts"]
            ax.stairs(counts, edges, fill=True, alpha=0.6)
            ax.axvline(0.0, color="black", lw=0.8)
            ax.axvline(s["mean"], color="red", lw=1.2, label=f"mean {s['mean']:.2e}\nstd {s['std']:.2e}")
            ax.set_title(f"{setting}: {title}", fontsize=9)
            ax.legend(fontsize=7)
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
    fig.suptitle("Shapes world, second optimizer step of each rollout (docs/results/trainers.md#grpo-guard-log-ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="runs/bench/guard_log_ratio.json")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="runs/guard_log_ratios", help="the runs' folders")
    args = p.parse_args()
    grpo_module.RatioControl = RecordingControl  # the GRPO loop builds its ratio control by this name
    data = {"command": f"python scripts/guard_log_ratios.py --json {args.json} --steps {args.steps}", "runs": {}}
    data["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    for setting, overrides in SETTINGS.items():
        data["runs"][setting] = {
            name: run(config, overrides, args.steps, Path(args.out) / setting / name) for name, config in RUNS.items()
        }
        for name, r in data["runs"][setting].items():
            s = r["log_ratio"]
            print(
                f"{setting:9s} {name:6s} log-ratio mean {s['mean']:+.3e} std {s['std']:.3e} "
                f"clip {r['clip_fraction']:.3f}"
            )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
