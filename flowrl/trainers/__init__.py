"""Trainers: one recipe per file, written on the kit (flowrl/trainers/kit.py) over the shared components.

`TRAINERS` maps a run config's `trainer:` key to its recipe class; each recipe class names its config
dataclass (`config_class`), which fills the config's `train:` section. `flowrl train`, `flowrl demo`,
`flowrl bench train` and `scripts/train.py` all go through `load_config` / `build_trainer` here.
"""

from __future__ import annotations

from pathlib import Path

from flowrl import config as run_config
from flowrl.experimental.tagrpo import TAGRPOConfig, TAGRPOTrainer
from flowrl.trainers.adjoint import AdjointMatchingConfig, AdjointMatchingTrainer
from flowrl.trainers.adv_grpo import AdvGRPOConfig, AdvGRPOTrainer
from flowrl.trainers.awm import AWMConfig, AWMTrainer
from flowrl.trainers.dgpo import DGPOConfig, DGPOTrainer
from flowrl.trainers.elbo import ELBOConfig, ELBOTrainer
from flowrl.trainers.gdro import GDROConfig, GDROTrainer
from flowrl.trainers.grpo import GRPOConfig, GRPOTrainer
from flowrl.trainers.nft import NFTConfig, NFTTrainer
from flowrl.trainers.ram import RAMConfig, RAMTrainer
from flowrl.trainers.smopd import SMOPDConfig, SMOPDTrainer

TRAINERS: dict[str, type] = {
    "grpo": GRPOTrainer,
    "nft": NFTTrainer,
    "ram": RAMTrainer,
    "adjoint_matching": AdjointMatchingTrainer,
    "awm": AWMTrainer,
    "dgpo": DGPOTrainer,
    "elbo": ELBOTrainer,
    "gdro": GDROTrainer,
    "adv_grpo": AdvGRPOTrainer,
    "smopd": SMOPDTrainer,
    "tagrpo": TAGRPOTrainer,  # experimental (flowrl/experimental/tagrpo.py)
}
DEFAULT_TRAINER = "grpo"


def trainer_class(name: str) -> type:
    if name not in TRAINERS:
        raise run_config.ConfigError(
            f"trainer={name!r} is not one of {', '.join(TRAINERS)}; set trainer: to one of them (grpo is the default)"
        )
    return TRAINERS[name]


def build_config(data: dict) -> run_config.RunConfig:
    """A validated RunConfig from plain data, its `train:` section parsed by the named recipe's config class."""
    name = (data or {}).get("trainer", DEFAULT_TRAINER)
    return run_config.build_config(data, trainer_class(str(name)).config_class)


def load_config(path: str | Path, overrides: list[str] | None = None) -> run_config.RunConfig:
    return build_config(run_config.read_config_data(path, overrides))


def build_trainer(cfg: run_config.RunConfig, accelerator=None):
    """The recipe of `cfg`. A sampler / balancer pair the recipe cannot train is refused by its constructor, before any
    model loads, with the recipe's own one-line reason (`composition_error`, the `flowrl recipes` matrix's "why")."""
    return trainer_class(cfg.trainer)(cfg, accelerator=accelerator)


__all__ = [
    "AdjointMatchingConfig",
    "AdjointMatchingTrainer",
    "AdvGRPOConfig",
    "AdvGRPOTrainer",
    "AWMConfig",
    "AWMTrainer",
    "DGPOConfig",
    "DGPOTrainer",
    "ELBOConfig",
    "ELBOTrainer",
    "GDROConfig",
    "GDROTrainer",
    "TRAINERS",
    "GRPOConfig",
    "GRPOTrainer",
    "NFTConfig",
    "NFTTrainer",
    "RAMConfig",
    "RAMTrainer",
    "SMOPDConfig",
    "SMOPDTrainer",
    "TAGRPOConfig",
    "TAGRPOTrainer",
    "build_config",
    "build_trainer",
    "load_config",
    "trainer_class",
]
