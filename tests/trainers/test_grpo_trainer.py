"""The GRPO recipe on a tiny SD3 pipeline: on-policy ratio, reference model, reward policy, bad input."""

import pytest
import torch
import yaml
from dotted import set_dotted

import flowrl.trainers.kit as kit
from flowrl.config import ConfigError
from flowrl.registry import REWARDS
from flowrl.trainers import build_config, load_config
from flowrl.trainers.grpo import GRPOTrainer
from flowrl.types import RewardOutput


def tiny_config(tmp_path, pipeline, **overrides):
    data = {
        "name": "t",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 2,
        "seed": 3,
        "model": {"path": pipeline, "lora_rank": 4},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 2, "group_size": 2},
        "sampler": {
            "name": "sde",
            "num_steps": 3,
            "height": 32,
            "width": 32,
            "guidance_scale": 2.0,
            "noise_level": 0.7,
        },
        "rewards": [{"name": "jpeg_compressibility"}],
        "train": {"learning_rate": 1e-3, "clip_range": 1e-3, "use_async_rewards": False},
        "logging": {"trackers": [], "progress_bar": False},
        "eval": {"num_steps": 2, "seeds": [0]},
    }
    set_dotted(data, overrides)
    return build_config(data)


@pytest.fixture(scope="module")
def sd3(tiny_pipeline):
    return tiny_pipeline("sd3")


def test_first_inner_step_is_exactly_on_policy(tmp_path, sd3):
    """Learning rate 0: the weights never move, so every recomputed log-prob must equal the rollout's."""
    cfg = tiny_config(tmp_path, sd3, **{"train.learning_rate": 0.0, "train.kl_coef": 0.1})
    metrics = GRPOTrainer(cfg).train_step()
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0
    assert metrics["train/approx_kl"] == 0.0 and metrics["train/clip_fraction"] == 0.0


def test_reference_forward_has_the_adapter_disabled(tmp_path, sd3, tiny_model):
    cfg = tiny_config(tmp_path, sd3)
    trainer = GRPOTrainer(cfg)
    with torch.no_grad():
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # a trained-looking adapter
    base = tiny_model("sd3")  # the same pipeline without any adapter
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = base.encode(["a red cat", "a blue dog"], guidance_scale=2.0)
    with torch.no_grad():
        v_base = base.velocity(x, 0.6, cond, 2.0)
        with trainer.parts.model.adapter_disabled():
            v_ref = trainer.parts.model.velocity(x, 0.6, cond, 2.0)
        v_policy = trainer.parts.model.velocity(x, 0.6, cond, 2.0)
    torch.testing.assert_close(v_ref, v_base, rtol=0, atol=1e-6)
    assert (v_policy - v_base).abs().max() > 1e-3


def test_training_moves_the_adapter_and_logs(tmp_path, sd3):
    cfg = tiny_config(
        tmp_path,
        sd3,
        **{
            "train.num_minibatches": 2,
            "train.num_rollout_batches": 2,
            "train.use_async_rewards": True,
            "train.kl_coef": 0.01,
        },
    )
    trainer = GRPOTrainer(cfg)
    before = [p.detach().clone() for p in trainer.parts.opt.params]
    out = kit.train(trainer)
    assert any((a - b).abs().max() > 0 for a, b in zip(before, trainer.parts.opt.params))
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for key in (
        "train/loss",
        "train/kl",
        "train/clip_fraction",
        "train/approx_kl",
        "train/ratio_mean",
        "reward/jpeg_compressibility/mean",
        "reward/jpeg_compressibility/std",
        "train/zero_std_fraction",
        "perf/samples_per_s",
    ):
        assert key in out["history"][0]
    assert (cfg.run_dir / "checkpoints" / "step_000002" / "lora" / "pytorch_lora_weights.safetensors").exists()


@REWARDS.register("test_flaky")
class FlakyReward:
    """Raises on prompts containing 'boom', inf on 'inf', NaN (not applicable) on 'nan', else the index."""

    modalities = ("image",)
    differentiable = False

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        if any("boom" in p for p in prompts):
            raise RuntimeError("scorer crashed")
        values = {"inf": float("inf"), "nan": float("nan")}
        return RewardOutput(
            torch.tensor([next((v for k, v in values.items() if k in p), float(i)) for i, p in enumerate(prompts)])
        )


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("boom", "reward 'test_flaky' failed on local samples 0..3.*at sample index 0"),
        ("inf", "reward 'test_flaky' failed.*inf"),
    ],
)
def test_reward_errors_raise_by_default(tmp_path, sd3, prompt, match):
    cfg = tiny_config(tmp_path, sd3, **{"rewards": [{"name": "test_flaky"}], "data.prompts": [prompt]})
    with pytest.raises(RuntimeError, match=match):
        GRPOTrainer(cfg).train_step()


def test_reward_errors_skip_samples_when_asked(tmp_path, sd3):
    cfg = tiny_config(
        tmp_path,
        sd3,
        **{"rewards": [{"name": "test_flaky"}], "data.prompts": ["inf"], "on_reward_error": "skip_sample"},
    )
    metrics = GRPOTrainer(cfg).train_step()
    assert metrics["reward/dropped_samples"] == 4 and metrics["train/reward_errors"] == 4
    assert metrics["train/loss"] == 0.0  # every sample dropped: nothing to learn from


def test_nan_means_not_applicable(tmp_path, sd3):
    cfg = tiny_config(tmp_path, sd3, **{"rewards": [{"name": "test_flaky"}], "data.prompts": ["nan"]})
    metrics = GRPOTrainer(cfg).train_step()  # no error under the default "raise" policy
    assert metrics["reward/dropped_samples"] == 0 and metrics["train/loss"] == 0.0


def test_non_finite_loss_skips_then_stops(tmp_path, sd3):
    trainer = GRPOTrainer(tiny_config(tmp_path, sd3, **{"train.max_consecutive_nan_steps": 2}))
    before = [p.detach().clone() for p in trainer.parts.opt.params]
    trainer.parts.opt.step(torch.tensor([float("nan")]))
    assert trainer.parts.opt.counters["skipped_nan_steps"] == 1 and all(
        torch.equal(a, b) for a, b in zip(before, trainer.parts.opt.params)
    )
    with pytest.raises(FloatingPointError, match="2 optimizer steps in a row"):
        trainer.parts.opt.step(torch.tensor([float("inf")]))


# ---------------------------------------------------------------------------------------------- bad input
def test_config_typo_suggests_closest_key(tmp_path, sd3):
    with pytest.raises(ConfigError, match=r"unknown key train.learning_rat; did you mean 'learning_rate'"):
        tiny_config(tmp_path, sd3, **{"train.learning_rat": 1.0})
    with pytest.raises(ConfigError, match=r"unknown key sampler.noise_levl; did you mean 'noise_level'"):
        tiny_config(tmp_path, sd3, **{"sampler.noise_levl": 1.0})


def test_unknown_reward_name(tmp_path, sd3):
    with pytest.raises(ConfigError, match=r"rewards.0.name: unknown reward 'pickscor'. Did you mean 'pickscore'"):
        tiny_config(tmp_path, sd3, rewards=[{"name": "pickscor"}])


def test_sizes_must_divide_across_processes(tmp_path, sd3):
    from accelerate import Accelerator

    cfg = tiny_config(tmp_path, sd3, **{"data.group_size": 3, "data.num_prompts_per_step": 1})
    accelerator = Accelerator(cpu=True)
    accelerator.state.num_processes = 2  # what the check sees under a 2-process launch
    try:
        with pytest.raises(ValueError, match="= 3 does not divide across 2 processes"):
            GRPOTrainer(cfg, accelerator=accelerator)
    finally:
        accelerator.state.num_processes = 1


def test_missing_prompts_file_and_empty_prompts(tmp_path, sd3):
    cfg = tiny_config(
        tmp_path,
        sd3,
        **{"data": {"prompts_file": str(tmp_path / "none.txt"), "num_prompts_per_step": 2, "group_size": 2}},
    )
    with pytest.raises(FileNotFoundError, match="none.txt' does not exist"):
        GRPOTrainer(cfg)
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    cfg = tiny_config(
        tmp_path,
        sd3,
        **{"data": {"prompts_file": str(tmp_path / "empty.txt"), "num_prompts_per_step": 2, "group_size": 2}},
    )
    with pytest.raises(ValueError, match="prompt list is empty"):
        GRPOTrainer(cfg)


def test_missing_config_file_and_bad_override(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump({"data": {"prompts": ["x"]}, "rewards": [{"name": "jpeg_compressibility"}]})
    )
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config(tmp_path / "c.yaml", ["seed"])
    assert load_config(tmp_path / "c.yaml", ["seed=5", "train.learning_rate=1e-5"]).train.learning_rate == 1e-5


def test_checkpoint_from_another_config_is_refused(tmp_path, sd3):
    cfg = tiny_config(tmp_path, sd3, num_steps=1)
    kit.train(GRPOTrainer(cfg))
    other = tiny_config(tmp_path, sd3, num_steps=2, **{"train.learning_rate": 5e-4, "checkpoint": {"resume": "latest"}})
    with pytest.raises(ValueError, match="keys train.learning_rate differ"):
        kit.train(GRPOTrainer(other))
