"""Tiny run configs for every row of the composition matrix (flowrl.trainers.compose), shared by
tests/trainers/test_compose.py and its 2-process worker: `python -m accelerate.commands.launch ... composition.py
ROWS.json OUT` runs one training step of every row in ROWS.json inside one launch and writes each row's trained weights
to OUT/<row index>.safetensors.

A sampler or balancer registered later gets only the shared tiny settings below (every sampler here takes
num_steps, height, width and guidance_scale; a new one that does not needs an entry in SAMPLER_SETTINGS)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.trainers import TRAINERS, build_config
from flowrl.trainers.compose import trainer_variants, variants

# Two, so every balancer has something to balance; both built for the test (importable here and in the 2-process
# worker, which runs from this folder). Redness differs for any two different images, so every group has reward spread
# by construction, where a learned judge can score a group's tiny samples all alike (advantages exactly 0). The second,
# tanh(10 · redness), ranks a group's samples as redness does: two rewards that rank a group of 2 oppositely give it
# per-reward advantages that cancel (GDPO's sum, MARBLE's min-norm gradient), and what is left of them is float32
# noise on which 2 processes and 1 disagree (measured with toy_artifact as the second reward, candidate pools of ODE
# samples: NFT + MARBLE's grad norm 6.933e-5 vs 6.934e-5, RAM + GDPO's weights 5.0e-5 apart).
REWARDS = [{"name": "redness.RednessReward"}, {"name": "steep_redness.SteepRednessReward"}]
SHARED_SAMPLER = {"num_steps": 2, "height": 16, "width": 16, "guidance_scale": 1.0}
SAMPLER_SETTINGS = {  # per sampler name, on top of SHARED_SAMPLER
    "tree": {"split_steps": [0], "branching": 2},  # one split: a tree of 2 leaves per prompt group
    "candidates": {"pool_size": 3, "preview_backend": "few_step", "preview_num_steps": 1},
}
# adv_grpo adds reward "adversarial" (its hinge-trained RM's margins are ±1) beside the configured ones
BALANCER_SETTINGS = {
    "sa_mrpo": {"bounds": {reward["name"]: [-1.0, 1.0] for reward in [*REWARDS, {"name": "adversarial"}]}}
}
TRAIN = {  # keys a recipe's config class lacks are dropped
    "learning_rate": 3e-3,
    # Adam's first step moves a weight by lr·g/(|g| + ε), steepest at g = 0 (slope lr/ε = 30): the bound beside
    # test_compose.TOLERANCE; with ε = 1e-6 and lr = 1e-2 weights moved by up to 8.9e-5
    "adam_epsilon": 1e-4,
    "use_async_rewards": False,
    "use_ema": True,
    "ema_every_n_steps": 1,
    "kl_coef": 0.0,
    "timestep_fraction": 0.5,  # NFT: 1 of the 2 grid times
    "num_loss_targets_per_sample": 1,  # RAM: one noising per endpoint
    "reward_multiplier": 10.0,  # RAM and adjoint matching
    "num_random_loss_times": 1,  # adjoint matching
    "teacher_steps": 1,  # SMOPD: one step per teacher
    # SMOPD's distillation without the division by mean|v_S − v̄_T|: teachers one step from the base leave
    # |v_S − v̄_T| ≈ 1e-3·|v|, so the division multiplies the velocities' float32 differences (1 vs 2 processes) by
    # about 1e3 in the gradient (weights 1.1e-5 apart); test_smopd.py and test_term_gradients.py cover the division
    "distill_self_normalised": False,
    "distill_coef": 100.0,  # the plain term's gradient then ~0.1x the divided one's, still most of the step's
}


def components() -> tuple[dict, dict]:
    """{label: ComponentConfig} of the registries' sampler and balancer variants (the matrix's labels)."""
    return dict(variants(SAMPLERS)), dict(variants(BALANCERS))


def row_data(row: dict, output_dir: str, name: str) -> dict:
    """The plain config data of one matrix row on the toy model: 2 prompts x group 2, 16x16, 2 steps, 1 training step;
    a trainer variant (`grpo(guard)`) adds its train keys."""
    samplers, balancers = components()
    sampler, balancer = samplers[row["sampler"]], balancers[row["balancer"]]
    trainer, options = {label: (name, keys) for label, name, keys in trainer_variants()}[row["trainer"]]
    fields = {f.name for f in dataclasses.fields(TRAINERS[trainer].config_class)}
    return {
        "name": name,
        "trainer": trainer,
        "output_dir": output_dir,
        "device": "cpu",
        "num_steps": 2,
        "seed": 3,
        "model": {"path": "toy", "lora_rank": 2, "lora_alpha": 2, "lora_target_modules": ["to_q", "to_v"]},
        "data": {"prompts": ["two red circles", "one blue square"], "num_prompts_per_step": 2, "group_size": 2},
        "sampler": {
            "name": sampler.name,
            **SHARED_SAMPLER,
            **SAMPLER_SETTINGS.get(sampler.name, {}),
            **sampler.kwargs,
        },
        "rewards": REWARDS,
        "balancer": {"name": balancer.name, **BALANCER_SETTINGS.get(balancer.name, {}), **balancer.kwargs},
        "train": {**{k: v for k, v in TRAIN.items() if k in fields}, **options},
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0, "keep_last": 2},
        "logging": {"trackers": [], "progress_bar": False},
    }


def row_config(row: dict, output_dir: str, name: str):
    return build_config(row_data(row, output_dir, name))


def trainable(trainer) -> dict:
    return {
        n: p.detach().clone().contiguous()
        for n, p in trainer.parts.model.transformer.named_parameters()
        if p.requires_grad
    }


def main(rows_file: str, out: str) -> None:
    """Under `accelerate launch`: one training step of every row, in one process group (one accelerator)."""
    import json

    import torch
    from safetensors.torch import save_file

    from flowrl.trainers import build_trainer
    from flowrl.training.distributed import make_accelerator

    torch.set_num_threads(1)
    rows = json.loads(Path(rows_file).read_text())
    Path(out).mkdir(parents=True, exist_ok=True)
    accelerator = None
    for i, row in enumerate(rows):
        cfg = row_config(row, str(Path(out) / "runs"), f"row{i}")
        accelerator = accelerator or make_accelerator(cfg)
        trainer = build_trainer(cfg, accelerator=accelerator)
        metrics = trainer.train_step()
        if accelerator.is_main_process:
            save_file(trainable(trainer), str(Path(out) / f"{i}.safetensors"))
            (Path(out) / f"{i}.json").write_text(json.dumps({"grad_norm": metrics["train/grad_norm"]}))
        del trainer
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:3])
