"""The GRPO recipe across precisions and batchings, each on the shipped toy model (CPU, seconds): the first pass's
ratio is exactly 1 at fp32, bf16 and fp16 (also for cps_sq log-probs), the fp16 gradient matches fp32's under loss
scaling, a cps step to σ = 0 is not trained, a trajectory depends neither on its batch-mates nor on the chunking
(shared group noise included), filter_zero_std normalises by the kept samples, and Rollout.concat keeps extras."""

import pytest
import torch
from dotted import set_dotted

from flowrl.registry import REWARDS, SAMPLERS
from flowrl.trainers import build_config
from flowrl.trainers.grpo import GRPOTrainer
from flowrl.training.prompts import GroupedPromptSampler
from flowrl.types import RewardOutput, Rollout

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square", "three green triangles"]


def toy_config(tmp_path, **overrides):
    data = {
        "name": "toy",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "seed": 2,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS[:2], "num_prompts_per_step": 2, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 4, "guidance_scale": 1.0, "noise_level": 0.8},
        "rewards": [{"name": "toy_attributes"}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {
            "learning_rate": 0.0,
            "clip_range": 1e-2,
            "use_async_rewards": False,
            "use_ema": False,
            "max_grad_norm": 1e9,
        },
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


def captured_gradients(trainer):
    """Run one train_step; the unscaled gradient the optimizer step saw, by parameter name."""
    grads, original = {}, trainer.parts.opt.step

    def step(losses):
        for name, p in zip(trainer.parts.opt.names, trainer.parts.opt.params):
            grads[name] = p.grad.detach().float().clone() / trainer.parts.opt.scaler.scale
        return original(losses)

    trainer.parts.opt.step = step
    metrics = trainer.train_step()
    return grads, metrics


def randomize_adapter(trainer, seed=0, std=0.05):
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_first_pass_ratio_is_exactly_one_at_every_precision(tmp_path, precision):
    """Rollout and training run the velocity under the same autocast (inside FlowModel.velocity)."""
    trainer = GRPOTrainer(toy_config(tmp_path, **{"model.mixed_precision": precision, "train.kl_coef": 0.1}))
    randomize_adapter(trainer)
    metrics = trainer.train_step()
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0, metrics
    assert metrics["train/approx_kl"] == 0.0


def test_fp16_gradient_is_nonzero_and_close_to_fp32(tmp_path):
    """The loss scaler keeps the mean-over-elements log-prob gradients above fp16's underflow: the on-policy
    fp16 step's gradient matches the fp32 step's on the same seeds. Both are on-policy, so each residual
    x' - mu is exactly s * xi with the same xi; they differ by fp16 rounding in the forward and backward only.
    An overflow at the loss scale would halve it and skip the step (the step is then repeated)."""
    grads = {}
    for precision in ("fp32", "fp16"):
        cfg = toy_config(
            tmp_path / precision, **{"model.mixed_precision": precision, "rewards": [{"name": "test_by_prompt"}]}
        )
        trainer = GRPOTrainer(cfg)
        randomize_adapter(trainer)
        for _ in range(10):
            trainer.parts.step = 0  # the same prompts and seeds each time
            grads[precision], metrics = captured_gradients(trainer)
            if metrics["train/optimizer_steps"] == 1:
                break
        assert metrics["train/optimizer_steps"] == 1 and metrics["train/skipped_nan_steps"] == 0
        if precision == "fp16":
            assert trainer.parts.opt.scaler.enabled and trainer.parts.opt.scaler.scale > 1.0
    a = torch.cat([g.flatten() for g in grads["fp32"].values()])
    b = torch.cat([g.flatten() for g in grads["fp16"].values()])
    assert torch.isfinite(b).all() and (b != 0).float().mean() > 0.9  # not trained on zeros
    cosine = float(a @ b / (a.norm() * b.norm()))
    assert cosine > 0.99, cosine  # stated tolerance: fp16 activations, the same objective
    assert abs(float(b.norm() / a.norm()) - 1) < 0.05


def test_cps_sq_rollout_trains_with_ratio_one(tmp_path):
    cfg = toy_config(tmp_path, **{"sampler.kind": "cps", "sampler.log_prob_mode": "cps_sq", "sampler.noise_level": 0.5})
    metrics = GRPOTrainer(cfg).train_step()
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0


def test_cps_step_to_zero_has_std_zero_and_is_not_trained(tmp_path):
    from flowrl.models import load_flow_model
    from flowrl.types import PromptBatch

    model = load_flow_model("toy")
    sampler = SAMPLERS.get("sde")(num_steps=4, kind="cps", noise_level=0.5, sde_window_size=2, sde_window_range=(2, 4))
    r = sampler(model, PromptBatch(PROMPTS[:1], torch.tensor([0]), seeds=torch.tensor([1])))
    assert r.noise_levels[0].tolist() == [0.0, 0.0, 0.5, 0.5]
    assert r.transitions.tolist() == [[0, 2]]  # the last step (to sigma = 0) has std 0 under cps


def test_same_latent_group_shares_noise_across_chunks_and_processes():
    """A group split over two processes (and over rollout chunks) starts from one initial noise."""
    from flowrl.models import load_flow_model

    model = load_flow_model("toy")
    prompt_sampler = GroupedPromptSampler(PROMPTS, num_prompts_per_step=1, group_size=4, seed=9)
    sampler = SAMPLERS.get("sde")(num_steps=2, noise_level=0.7, same_latent=True, decode=False)
    halves = [sampler(model, prompt_sampler.local_batch(3, rank, 2)) for rank in range(2)]
    chunks = [sampler(model, prompt_sampler.global_batch(3).select(slice(i, i + 1))) for i in range(4)]
    starts = torch.cat([r.latents[:, 0] for r in halves] + [r.latents[:, 0] for r in chunks])  # [8, ...]
    assert all(torch.equal(starts[0], s) for s in starts)


def test_a_trajectory_does_not_depend_on_its_batch_mates_or_the_chunking(tmp_path):
    """Random SDE windows differ per sample; each sample draws step noise only at its own stochastic steps."""
    from flowrl.models import load_flow_model

    model = load_flow_model("toy")
    prompt_sampler = GroupedPromptSampler(PROMPTS, num_prompts_per_step=2, group_size=4, seed=4)
    batch = prompt_sampler.global_batch(0)
    sampler = SAMPLERS.get("sde")(
        num_steps=6, noise_level=0.9, sde_window_size=2, sde_window_range=(0, 5), decode=False
    )
    whole = sampler(model, batch)
    starts = {int(r.nonzero()[0]) for r in whole.noise_levels}
    assert len(starts) > 1  # the windows really differ within the batch
    four = Rollout.concat([sampler(model, batch.select(slice(2 * c, 2 * c + 2))) for c in range(4)])
    alone = Rollout.concat([sampler(model, batch.select([i])) for i in range(len(batch.prompts))])
    for other in (four, alone):
        torch.testing.assert_close(other.latents, whole.latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(other.log_probs, whole.log_probs, rtol=0, atol=1e-4)
        assert torch.equal(other.transitions, whole.transitions)


@REWARDS.register("test_by_prompt")
class ByPromptReward:
    """1.0 for every sample of 'two red circles' (a zero-spread group), the sample's index otherwise."""

    modalities = ("image",)
    differentiable = False

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput(torch.tensor([1.0 if p == "two red circles" else float(i) for i, p in enumerate(prompts)]))


def test_filter_zero_std_normalises_by_the_kept_samples(tmp_path):
    """Half the samples have advantage 0: filtered, the same gradient is divided by 2 samples, not 4."""
    grads = {}
    for flag in (False, True):
        cfg = toy_config(
            tmp_path / str(flag), **{"rewards": [{"name": "test_by_prompt"}], "train.filter_zero_std": flag}
        )
        trainer = GRPOTrainer(cfg)
        assert set(trainer.parts.prompt_sampler.global_batch(0).prompts) == {"two red circles", "one blue square"}
        grads[flag], metrics = captured_gradients(trainer)
        assert metrics["train/kept_samples"] == (2.0 if flag else 4.0)
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], 2 * grads[False][name], rtol=1e-5, atol=1e-12)


def test_rollout_concat_keeps_extras_and_offsets_transitions(tmp_path):
    from flowrl.models import load_flow_model
    from flowrl.types import PromptBatch

    model = load_flow_model("toy")
    sampler = SAMPLERS.get("sde")(num_steps=3, noise_level=0.7, decode=False)
    parts = [
        sampler(model, PromptBatch(PROMPTS[i : i + 1], torch.tensor([i]), seeds=torch.tensor([i + 5])))
        for i in range(2)
    ]
    for i, part in enumerate(parts):
        part.extras.update(parents=[f"p{i}"], kind_note="same")
    joined = Rollout.concat(parts)
    assert joined.extras["seeds"].tolist() == [5, 6] and joined.extras["parents"] == ["p0", "p1"]
    assert joined.extras["kind_note"] == "same"
    assert joined.transitions.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    parts[1].extras["kind_note"] = "other"
    with pytest.raises(ValueError, match="extra 'kind_note'"):
        Rollout.concat(parts)
