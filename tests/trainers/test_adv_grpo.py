"""Adv-GRPO (docs/recipes/adv_grpo.md) against numbers computed independently: the hinge RM loss is 0 exactly when every
real logit is >= 1 and every fake one <= -1, the Bradley–Terry loss equals softplus(ℓ(cos_gen − cos_ref)) and −log
softmax by hand, the DINO-head reward in float64 by hand on a tiny case (deterministic once the patches are seeded), the
schedule's truth table, one RM step's gradient and Adam update by hand; then the recipe: a resume bit for bit across
RM-only and generator epochs, 2 gloo processes = 1 with the same RM on both, a short run of configs/toy/adv_grpo.yaml,
and one-line errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from launching import assert_same_checkpoints, one_and_two_processes, straight_and_resumed
from safetensors.torch import load_file
from test_grpo_processes import write_config
from test_trainer_contract import assert_same, toy_config

import flowrl.trainers.kit as kit
from flowrl.trainers import build_trainer, load_config
from flowrl.training.adversarial import (
    AdversarialConfig,
    AdversarialReward,
    References,
    head_reward,
    hinge_loss,
    patch_draw,
    preference_loss,
    schedule_step,
)
from flowrl.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]


def test_hinge_loss_is_zero_exactly_when_every_margin_holds():
    real, fake = torch.tensor([1.0, 2.5, 1.0]), torch.tensor([-1.0, -3.0, -1.2])
    assert float(hinge_loss(real, fake)) == 0.0
    for r, f in ((real - torch.tensor([0.0, 0.0, 1e-3]), fake), (real, fake + torch.tensor([1e-3, 0.0, 0.0]))):
        assert float(hinge_loss(r, f)) > 0.0
    r, f = torch.tensor([0.5, 2.0]), torch.tensor([0.0, -2.0])  # ½[(0.5 + 0)/2 + (1 + 0)/2]
    assert float(hinge_loss(r, f)) == pytest.approx(0.375, rel=1e-7)
    assert float(hinge_loss(r, f, count=4)) == pytest.approx(0.1875, rel=1e-7)  # a count over every process


def test_preference_loss_is_the_bradley_terry_softplus():
    scale = torch.tensor(100.0, dtype=torch.float64)
    cos_gen = torch.tensor([0.21, 0.30, 0.25], dtype=torch.float64)
    cos_ref = torch.tensor([0.24, 0.22, 0.25], dtype=torch.float64)
    by_hand = [math.log1p(math.exp(100.0 * (g - r))) for g, r in zip(cos_gen.tolist(), cos_ref.tolist())]
    assert preference_loss(scale, cos_gen, cos_ref).tolist() == pytest.approx(by_hand, rel=1e-12)
    logits = torch.stack([scale * cos_ref, scale * cos_gen], 1)  # label 0: the reference is preferred
    assert torch.allclose(preference_loss(scale, cos_gen, cos_ref), -logits.log_softmax(1)[:, 0], rtol=1e-12, atol=0)


def tiny_head(d=3, hidden=2):
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1)).double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return head


def test_the_head_reward_by_hand_and_its_seeded_patches():
    head = tiny_head()
    tokens = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # CLS + 4 patches
    index = patch_draw(seed=7, version=2, purpose=0, rows=2, num_tokens=4, num=6)
    assert torch.equal(index, patch_draw(7, 2, 0, 2, 4, 6)) and not torch.equal(index, patch_draw(7, 3, 0, 2, 4, 6))
    (w1, b1), (w2, b2) = (
        (head[0].weight.tolist(), head[0].bias.tolist()),
        (head[2].weight.tolist()[0], head[2].bias.item()),
    )

    def h(x):
        norm = math.sqrt(sum(v * v for v in x)) + 1e-6
        x = [v / norm for v in x]
        pre = [sum(w * v for w, v in zip(row, x)) + b for row, b in zip(w1, b1)]
        gelu = [u * 0.5 * (1 + math.erf(u / math.sqrt(2))) for u in pre]
        return sum(w * u for w, u in zip(w2, gelu)) + b2

    expected = [
        0.7 * h(tokens[i, 0].tolist()) + 0.3 * sum(h(tokens[i, 1 + k].tolist()) for k in index[i].tolist()) / 6
        for i in range(2)
    ]
    got = head_reward(head, tokens, index, 0.7)
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    assert torch.equal(got, head_reward(head, tokens, index, 0.7))  # deterministic once the patches are seeded


def test_the_schedule_truth_table():
    assert [schedule_step("every_epoch", e, 10) for e in (0, 9)] == [(True, True)] * 2
    table = [schedule_step("every_k_epochs", e, 3) for e in range(6)]  # the DINO code: generator on (epoch+1) % 3 == 0
    assert table == [(False, True), (False, True), (True, False)] * 2
    assert schedule_step("gate_ref_below_gen", 0, 10, ref_mean=0.1, gen_mean=0.2) == (False, True)  # RM step only
    assert schedule_step("gate_ref_below_gen", 0, 10, ref_mean=0.2, gen_mean=0.2) == (True, False)
    assert schedule_step("gate_ref_below_gen", 0, 10, ref_mean=0.3, gen_mean=0.2) == (True, False)


class TokensAreImages(torch.nn.Module):
    def forward(self, images):  # the "images" of this test are already token tensors [N, 1+P, D]
        return images


def test_one_rm_step_by_hand():
    """A linear head h(x) = w·x + b on normalised tokens: the hinge gradient by hand, then Adam's first step
    θ − lr·g/(|g| + 1e-8) (bias-corrected moments of one step)."""
    from accelerate import Accelerator

    a = AdversarialConfig(learning_rate=0.01, num_patches=3)
    rm = AdversarialReward(a, seed=0, accelerator=Accelerator(cpu=True))
    rm.backbone = TokensAreImages()
    rm.head = torch.nn.Linear(2, 1)
    with torch.no_grad():
        rm.head.weight.copy_(torch.tensor([[0.5, -1.5]])), rm.head.bias.copy_(torch.tensor([0.2]))
    rm.optimizer = torch.optim.Adam(rm.head.parameters(), lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2))
    g = torch.Generator().manual_seed(4)
    refs, gens = torch.randn(2, 4, 2, generator=g), torch.randn(2, 4, 2, generator=g)  # 2 pairs, CLS + 3 patches
    index, total = torch.tensor([1, 3]), 4
    w, b = rm.head.weight.detach().clone()[0].tolist(), float(rm.head.bias.detach())
    grad_w, grad_b = [0.0, 0.0], 0.0

    def add(x, sign, scale):  # ∂ relu(1 − sign·h(x̂)) = −sign·(x̂, 1) where the margin is not met
        nonlocal grad_b
        norm = math.sqrt(sum(v * v for v in x)) + 1e-6
        x = [v / norm for v in x]
        if 1 - sign * (w[0] * x[0] + w[1] * x[1] + b) > 0:
            grad_w[0] -= sign * x[0] * scale
            grad_w[1] -= sign * x[1] * scale
            grad_b -= sign * scale

    for purpose, images, sign in ((1, refs, 1.0), (2, gens, -1.0)):
        draw = patch_draw(0, 0, purpose, total, 3, 3)[index]
        for i in range(2):
            add(images[i, 0].tolist(), sign, 0.5 / 2)  # L_img: ½ mean over the 2 pairs
            for k in draw[i].tolist():
                add(images[i, 1 + k].tolist(), sign, a.patch_loss_coef * 0.5 / 6)  # L_patch: over 2 × 3 patches
    stats = rm.update(refs, gens, index, total)
    assert rm.head.weight.grad[0].tolist() == pytest.approx(grad_w, rel=1e-5)
    assert float(rm.head.bias.grad) == pytest.approx(grad_b, rel=1e-5)
    step = [wi - 0.01 * gi / (abs(gi) + 1e-8) for wi, gi in zip(w, grad_w)]
    assert (
        rm.head.weight[0].tolist() == pytest.approx(step, rel=1e-5) and rm.version == 1 and stats["train/rm_pairs"] == 2
    )


def test_references_from_the_world_and_from_a_json_file(tmp_path):
    from flowrl.media import save_image
    from flowrl.toy.world import parse_prompt, render

    images, rows = References("world")(["two red circles", "a cat", "one blue square"], [5, 6, 7], (32, 32))
    assert rows == [0, 2] and torch.equal(images[0], render(parse_prompt("two red circles"), 5))
    save_image(torch.rand(3, 16, 16), tmp_path / "a.png")
    (tmp_path / "references.json").write_text(json.dumps({"a cat": ["a.png"]}))
    images, rows = References(str(tmp_path))(["a cat", "a dog"], [0, 1], (32, 32))
    assert rows == [0] and images.shape == (1, 3, 32, 32)
    with pytest.raises(FileNotFoundError, match=r"train.adversarial.references='nowhere.json' is neither 'world'"):
        References("nowhere.json")


def adv_config(tmp_path, **overrides):
    """The contract test's toy config for trainer adv_grpo (SDE rollouts of 2 steps, redness reward; references: the
    world's renders of its Shapes prompts)."""
    return toy_config(tmp_path, "adv_grpo", **{"train.adversarial.learning_rate": 1e-2, **overrides})


def test_resumes_bit_for_bit_across_rm_only_and_generator_epochs(tmp_path):
    extra = {
        "checkpoint.every_n_steps": 1,
        "train.adversarial.schedule": "every_k_epochs",
        "train.adversarial.d_times": 2,
    }
    keys = ("trainable", "optimizer", "trainer_state")
    straight, lines, resumed = straight_and_resumed(adv_config, tmp_path, extra, steps=3, keys=keys)
    assert [x["train/generator_updated"] for x in lines] == [0.0, 1.0, 0.0]
    assert [x["train/rm_version_scored"] for x in lines] == [0.0, 1.0, 1.0]  # the RM steps after epochs 0 and 2
    a = load_checkpoint(straight.run_dir / "checkpoints" / "step_000003")
    assert a["trainer_state"]["adversarial_rm"] == {"version": 2}
    rms = [
        load_file(str(c.run_dir / "checkpoints" / "step_000003" / "adversarial_rm.safetensors"))
        for c in (straight, resumed.parts.cfg)
    ]
    assert_same(*rms, "adversarial_rm")
    assert any(k.startswith("adam.") for k in rms[0])


def test_two_gloo_processes_match_one_process(tmp_path):
    """The RM's gradients summed over both processes: the same RM on both (spread 0) and as on one process."""
    extra = {
        "trainer": "adv_grpo",
        "model": {"path": "toy", "lora_rank": 4},
        "data": {"prompts": ["two red circles", "one blue square"], "num_prompts_per_step": 1, "group_size": 4},
        "sampler": {
            "name": "sde",
            "num_steps": 2,
            "height": 32,
            "width": 32,
            "guidance_scale": 1.0,
            "noise_level": 0.8,
        },
        "rewards": [{"name": "toy_attributes", "weight": 0.0}],
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    extra["train"] = {
        "learning_rate": 3e-3,
        "clip_range": 1e-2,
        "use_async_rewards": False,
        "adversarial": {"learning_rate": 1e-2},
    }
    runs, lines = one_and_two_processes(tmp_path, write_config(tmp_path, "toy", "one", **extra))
    for key in ("reward/adversarial/mean", "train/rm_loss", "train/grad_norm"):
        values = [[x[key] for x in run] for run in lines]
        assert values[0] == pytest.approx(values[1], rel=1e-4), (key, values)
    steps = len(lines[1])
    assert [x["train/rm_spread"] for x in lines[1]] == [0.0] * steps and lines[1][-1]["train/rm_version"] == steps
    assert_same_checkpoints(runs, ("trainable.safetensors",), step=f"step_{steps:06d}")
    # Adam divides by √v: a head weight whose gradient is ~1e-7 moves by ~lr either way, so summation order shows
    assert_same_checkpoints(runs, ("adversarial_rm.safetensors",), step=f"step_{steps:06d}", tolerance=2e-4)


def test_the_toy_config_runs(tmp_path):
    small = ["data.num_prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "eval.every_n_steps=0"]
    cfg = load_config(
        ROOT / "configs" / "toy" / "adv_grpo.yaml",
        [f"output_dir={tmp_path}", "num_steps=2", "logging.trackers=[]", "logging.progress_bar=false", *small]
        + ["eval.seeds=[0]", "eval.num_steps=2", "checkpoint.every_n_steps=0"],
    )
    kit.train(build_trainer(cfg))
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/rm_version"] for x in lines] == [1.0, 2.0] and all(
        x["train/rm_missing_references"] == 0 for x in lines
    )
    assert all(math.isfinite(x["train/loss"]) and math.isfinite(x["reward/adversarial/mean"]) for x in lines)
    assert lines[0]["work/train/reward/adversarial"] == 16.0  # the RM step's backbone forwards: 8 pairs


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"train.adversarial.schedule='often' is unknown; use one of every_epoch"):
        build_trainer(adv_config(tmp_path, **{"train.adversarial.schedule": "often"}))
    with pytest.raises(ValueError, match=r"train.adversarial.d_times=0 must be > 0"):
        build_trainer(adv_config(tmp_path, **{"train.adversarial.d_times": 0}))
    with pytest.raises(ValueError, match=r"train.adversarial.cls_weight=1.5 must be in \[0, 1\]"):
        build_trainer(adv_config(tmp_path, **{"train.adversarial.cls_weight": 1.5}))
    with pytest.raises(ValueError, match="balancer marble balances per-reward gradients .* use balancer weighted_sum"):
        build_trainer(adv_config(tmp_path, **{"balancer": {"name": "marble"}}))
    with pytest.raises(FileNotFoundError, match=r"train.adversarial.backbone='nowhere' is none of toy_attributes"):
        build_trainer(adv_config(tmp_path, **{"train.adversarial.backbone": "nowhere"}))
