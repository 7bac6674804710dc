"""SMOPD (specialize-and-merge online policy distillation) on DiffusionNFT, as one recipe over the shared components.
The mapping to flow models, its choices and the toy numbers are in docs/recipes/smopd.md.

    flowrl train configs/toy/smopd.yaml

Stage 1, specialize (before the first step, or reused from `train.teacher_dir`): one LoRA teacher per reward
priority, each a DiffusionNFT run of `train.teacher_steps` steps from the same base, its advantages the teacher
balancer's (GDPO by default) with weight 1 on the priority rewards and `others` on the rest. The teachers' work and
seconds are billed at the run's first step (perf/offline_s), as the GDRO pool is.

Stage 2, merge: the student (a fresh adapter, the run's `default`) is DiffusionNFT on its own rollouts, with the
run's rewards and balancer (the sparse rewards left to the teachers by weight 0), plus, at every training time,

    distill_coef · mean(d²) / sg(mean|d|),   d = v_S(x_t) − sg(v̄_T(x_t)),   v̄_T = Σ_k λ_k v_k
                                              (λ: each teacher's `mix`, uniform by default)

at the student's own noised endpoints x_t: the teachers ride on the transformer as extra adapters, one forward each
per training time. The λ-weighted sum of per-teacher losses has the same gradient (losses.blended_velocity).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import flowrl.trainers.kit as kit
from flowrl.config import RunConfig, build_config, to_dict
from flowrl.losses import blended_velocity, velocity_distill_loss
from flowrl.trainers.nft import NFTConfig, NFTTrainer, nft_parts, nft_step
from flowrl.training.clock import timed
from flowrl.training.distributed import full, like, make_accelerator
from flowrl.training.loop import metered_step


@dataclass
class SMOPDConfig(NFTConfig):
    teachers: list[dict] = field(default_factory=list)
    """One entry per teacher: {priority: [reward, ...], others: 0.2, mix: λ}; weight 1 on the priority rewards,
    `others` on the rest in the teacher's balancer; `mix` its share of the blended target (default: uniform).
    Empty: one teacher per reward, that reward its priority."""
    teacher_steps: int = 20
    """DiffusionNFT steps of each teacher (stage 1), with the run's settings."""
    teacher_balancer: dict = field(default_factory=lambda: {"name": "gdpo", "eps": 1e-4})
    """The teachers' balancer (GDPO: each reward normalised per prompt, then the priority weights)."""
    teacher_dir: str | None = None
    """Where the teachers are written and found again (default: <run dir>/teachers); a folder made with other
    settings is refused."""
    distill_coef: float = 1.0
    """Weight of the distillation term beside the student's NFT loss."""
    distill_self_normalised: bool = True
    """Divide each sample's mean((v_S − v̄_T)²) by sg(mean|v_S − v̄_T|) (the scale of NFT's own loss); false: plain."""


def teacher_weights(spec: dict, rewards: list[str]) -> dict[str, float]:
    """A teacher's reward weights: 1 on its priority rewards, `others` (default 0.2) on the rest."""
    if not isinstance(spec, dict) or set(spec) - {"priority", "others", "mix"}:
        raise ValueError(
            f"train.teachers entry {spec!r}: write {{priority: [reward, ...], others: 0.2, mix: 0.5}} (others, mix "
            "optional)"
        )
    priority = spec.get("priority", [])
    priority = [priority] if isinstance(priority, str) else list(priority)
    unknown = [name for name in priority if name not in rewards]
    if not priority or unknown:
        raise ValueError(
            f"train.teachers entry {spec}: priority must name some of the run's rewards ({', '.join(rewards)}); "
            f"{'unknown: ' + ', '.join(unknown) if unknown else 'it names none'}"
        )
    others = float(spec.get("others", 0.2))
    return {name: 1.0 if name in priority else others for name in rewards}


def teacher_specs(cfg: RunConfig) -> list[dict]:
    """`train.teachers`, or one teacher per reward (that reward its priority) where it is empty."""
    return list(cfg.train.teachers) or [{"priority": [r.name]} for r in cfg.rewards]


def teacher_config(cfg: RunConfig, index: int, folder: Path) -> RunConfig:
    """Teacher `index`'s DiffusionNFT run: the run's config with the teacher's reward weights and balancer."""
    t = cfg.train
    data = to_dict(cfg)
    weights = teacher_weights(teacher_specs(cfg)[index], [r.name for r in cfg.rewards])
    for reward in data["rewards"]:
        reward["weight"] = weights[reward["name"]]
    nft_keys = {f for f in NFTConfig.__dataclass_fields__}
    data |= {"trainer": "nft", "name": f"teacher_{index}", "output_dir": str(folder), "num_steps": t.teacher_steps}
    data["train"] = {k: v for k, v in data["train"].items() if k in nft_keys}
    data["balancer"] = dict(t.teacher_balancer)
    data["eval"]["every_n_steps"], data["checkpoint"]["every_n_steps"] = 0, 0
    data["logging"] = {"trackers": [], "progress_bar": False}
    return build_config(data, NFTConfig)


def _settings(cfg: RunConfig) -> dict:
    """What a teacher folder must have been made with: the teachers' configs, less where they were written."""
    folder = Path("teachers")
    out = [to_dict(teacher_config(cfg, i, folder)) for i in range(len(teacher_specs(cfg)))]
    for data in out:
        data.pop("checkpoint"), data.pop("logging"), data.pop("eval")
    return {"teachers": out}


def train_teachers(cfg: RunConfig, acc, folder: Path) -> dict:
    """Stage 1: every teacher's adapter in `folder` (teacher_<i>.pt, full tensors, names of the `default` adapter)
    and manifest.json (settings, seconds, work); made where missing, refused where made with other settings."""
    manifest_path, settings = folder / "manifest.json", _settings(cfg)
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest["settings"] != json.loads(json.dumps(settings)):
            raise ValueError(
                f"train.teacher_dir={str(folder)!r} holds teachers made with other settings; delete it or point "
                "train.teacher_dir at a new folder"
            )
        return manifest
    wall, cpu, work = timed(acc.device), time.process_time(), {}
    for index in range(len(teacher_specs(cfg))):
        teacher = NFTTrainer(teacher_config(cfg, index, folder), acc)
        try:
            for _ in range(cfg.train.teacher_steps):
                for key, value in metered_step(teacher).items():
                    if key.startswith("work/"):
                        work[key] = work.get(key, 0.0) + value
        finally:
            if teacher.parts.scorer is not None:
                teacher.parts.scorer.close()
        weights, _ = teacher.parts.evaluation.weights(teacher.parts.step)  # what the teacher's run evaluates (its EMA)
        with weights:
            state = {
                name: full(p.detach()).cpu() for name, p in teacher.parts.model.adapter_parameters("default").items()
            }
        if acc.is_main_process:
            torch.save(state, folder / f"teacher_{index}.pt")
        del teacher, weights
        acc.free_memory()  # accelerate holds the teacher's prepared model and optimizer until told to let go
    manifest = {"settings": settings, "seconds": wall.seconds(), "cpu_seconds": time.process_time() - cpu}
    manifest["work"] = work
    if acc.is_main_process:
        manifest_path.write_text(json.dumps(manifest, indent=1))
    acc.wait_for_everyone()
    return manifest


class SMOPDTrainer:
    config_class = SMOPDConfig
    name = "smopd"
    adapter_copies = 1  # OLD; the teachers ride beside it, one adapter each (frozen, len(teacher_specs(cfg)))
    full_reference_copy = False
    cfg_doubles_train_rows = False  # NFT's: CFG-free
    trains_on = "rollout_steps"  # NFT's training times among the rollout's grid times
    plan_overrides = ("train.teacher_steps=1",)  # flowrl plan prices a student step; the teachers are offline work

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """DiffusionNFT's (the student and the teachers are NFT runs; docs/recipes/compose.md)."""
        return NFTTrainer.composition_error(sampler, balancer, train, rewards)

    def __init__(self, cfg: RunConfig, accelerator=None):
        t, specs = cfg.train, teacher_specs(cfg)
        for spec in specs:
            teacher_weights(spec, [r.name for r in cfg.rewards])  # a priority naming no reward of the run fails here
        if t.teacher_steps < 1 or t.distill_coef < 0:
            raise ValueError(
                f"train.teacher_steps={t.teacher_steps} must be >= 1 and distill_coef={t.distill_coef} >= 0"
            )
        mix = torch.tensor([float(s.get("mix", 1.0 / len(specs))) for s in specs], dtype=torch.float64)
        if (mix < 0).any() or abs(float(mix.sum()) - 1.0) > 1e-6:
            raise ValueError(
                f"train.teachers mix values {mix.tolist()} must be >= 0 and sum to 1 (leave them out: uniform)"
            )
        self.mix, self.distill_losses = mix.float(), []
        acc = accelerator or make_accelerator(cfg)
        folder = Path(t.teacher_dir) if t.teacher_dir else cfg.run_dir / "teachers"
        folder.mkdir(parents=True, exist_ok=True)
        self.teacher_manifest = train_teachers(cfg, acc, folder)
        self.offline_work = dict(self.teacher_manifest["work"])  # billed at the first step (flowrl plan leaves it out)
        self.teacher_names = [f"teacher_{i}" for i in range(len(specs))]
        # the student: θ and θ_old at the reference, the teachers as extra adapters
        self.parts, self.guidance = nft_parts(cfg, acc, type(self), teachers=tuple(self.teacher_names))
        for index, name in enumerate(self.teacher_names):
            saved = torch.load(folder / f"teacher_{index}.pt", map_location="cpu", weights_only=True)
            live = self.parts.model.adapter_parameters(name)
            with torch.no_grad():
                for key, tensor in live.items():
                    tensor.copy_(like(saved[key.replace(f".{name}.", ".default.")], tensor))
            for tensor in live.values():
                tensor.requires_grad_(False)

    def distill(self, x_t, sigma, cond, v_theta) -> torch.Tensor:
        """distill_coef · mean((v_S − sg(Σ_k λ_k v_k))²) per sample at this training time [b]."""
        model = self.parts.model
        with torch.no_grad():
            velocities = []
            for name in self.teacher_names:
                with model.using_adapter(name):
                    velocities.append(model.velocity(x_t, sigma, cond, self.guidance))
            target = blended_velocity(torch.stack(velocities), self.mix)
        t = self.parts.cfg.train
        loss = velocity_distill_loss(v_theta, target, t.distill_self_normalised)  # [b]
        self.distill_losses.append(loss.detach().mean())
        return t.distill_coef * loss

    def train_step(self) -> dict[str, float]:
        first, self.distill_losses = self.parts.step == 0, []
        metrics = nft_step(self.parts, self.guidance, extra_loss=self.distill)  # DiffusionNFT's, with the distillation
        metrics["train/distill_loss"] = float(torch.stack(self.distill_losses).mean())  # before distill_coef
        if first:  # the teachers' work and seconds, billed once (flowrl plan leaves them out of the per-step price)
            metrics |= kit.bill_offline(self.parts, self.teacher_manifest)
        return metrics
