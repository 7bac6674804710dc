"""GDRO (docs/recipes/gdro.md) against numbers computed independently: the group loss's identities (k = 2, τ → 0 is
Diffusion-DPO's −log σ(s1 − s2); ∂L/∂s_j = Σ_{i≤min(j,k−1)}(p_i(j) − q_i(j)); the internal sort makes it
permutation-invariant; equal rewards give no gradient), the loss and its gradient in the velocity by hand in float64;
the corrected score by hand; then the recipe: the offline pool (resumed after an interruption, reused without a
forward, a mismatched pool refused), a resume bit for bit, 2 gloo processes = 1, a short run of configs/toy/gdro.yaml,
and one-line errors."""

import json
import math

import pytest
import torch
from launching import assert_same_checkpoints, one_and_two_processes, straight_and_resumed, toy_config_run
from test_grpo_processes import write_config
from test_trainer_contract import assert_same, toy_config

import flowrl.training.pool as pool_module
from flowrl import work
from flowrl.losses import dsm_loss, gdro_implicit_reward, gdro_loss
from flowrl.trainers import build_trainer
from flowrl.training.evaluation import corrected_score
from flowrl.training.loop import metered_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def by_hand(s: list[float], r: list[float], tau: float, top1: bool = False) -> tuple[float, list[float]]:
    """The Plackett–Luce loss and ∂L/∂s in Python floats: items sorted by r descending, positions i < k − 1
    (top1: 0)."""
    k = len(s)
    order = sorted(range(k), key=lambda j: -r[j])
    loss, grad = 0.0, [0.0] * k
    for i in range(1 if top1 else k - 1):
        rest = order[i:]
        z = sum(math.exp(s[m]) for m in rest)
        zq = sum(math.exp(r[m] / tau) for m in rest) if tau > 0 else None
        q = {m: (math.exp(r[m] / tau) / zq if tau > 0 else float(m == order[i])) for m in rest}
        loss += math.log(z) - sum(q[m] * s[m] for m in rest)
        for m in rest:
            grad[m] += math.exp(s[m]) / z - q[m]  # p_i(m) − q_i(m)
    return loss, grad


def test_two_items_at_tau_zero_are_diffusion_dpo():
    s = torch.tensor([[0.7, -0.4], [-1.3, 0.2]], dtype=torch.float64)
    r = torch.tensor([[1.0, 0.0], [0.3, 0.9]], dtype=torch.float64)  # the second group's winner is its second item
    want = [-math.log(1 / (1 + math.exp(-(0.7 + 0.4)))), -math.log(1 / (1 + math.exp(-(0.2 + 1.3))))]
    for mode, tau in (("pl", 0.0), ("rank", 0.05), ("pl", 1e-4)):
        loss, st = gdro_loss(s, r, tau, mode)
        assert loss.tolist() == pytest.approx(want, rel=1e-12), (mode, tau)
    assert st["top"].tolist() == [0, 1] and st["signal"].all()


@pytest.mark.parametrize("mode", ["pl", "top1"])
def test_the_loss_and_its_gradient_in_s_by_hand(mode):
    s0 = [0.3, -1.1, 0.8, 0.05, -0.6]
    r0 = [0.2, 0.9, 0.4, 0.25, 0.0]  # unsorted
    s = torch.tensor([s0], dtype=torch.float64, requires_grad=True)
    loss, _ = gdro_loss(s, torch.tensor([r0], dtype=torch.float64), 0.3, mode)
    loss.sum().backward()
    want, grad = by_hand(s0, r0, 0.3, top1=mode == "top1")
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    assert s.grad[0].tolist() == pytest.approx(grad, rel=1e-10, abs=1e-14)
    assert float(s.grad.sum()) == pytest.approx(0.0, abs=1e-12)  # each position's p and q both sum to 1


def test_permuting_the_items_leaves_the_loss_unchanged():
    g = torch.Generator().manual_seed(3)
    s, r = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.rand(4, 6, generator=g, dtype=torch.float64)
    perm = torch.randperm(6, generator=g)
    a, sa = gdro_loss(s, r, 0.05)
    b, sb = gdro_loss(s[:, perm], r[:, perm], 0.05)
    assert torch.allclose(a, b, rtol=1e-13, atol=0)
    assert torch.equal(perm[sb["top"]], sa["top"])  # the same item ranks first


def test_equal_rewards_carry_no_gradient_and_ties_break_by_input_order_or_a_generator():
    s = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    loss, st = gdro_loss(s, torch.full((1, 4), 0.5, dtype=torch.float64), 0.05)
    loss.sum().backward()
    assert float(loss) == 0.0 and not st["signal"].any() and torch.equal(s.grad, torch.zeros_like(s))
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    assert gdro_loss(s.detach(), r, 0.05)[1]["order"].tolist() == [[0, 2, 1, 3]]  # stable: ties keep input order
    orders = {
        tuple(gdro_loss(s.detach(), r, 0.05, generator=torch.Generator().manual_seed(i))[1]["order"][0].tolist())
        for i in range(20)
    }
    assert len(orders) > 1 and all(set(o[:2]) == {0, 2} for o in orders)  # random among ties, never across rewards


def test_the_loss_and_its_gradient_in_the_velocity_by_hand():
    """k = 3 items of 2x2 latents; s = −β(ℓ_θ − ℓ_ref), L = PL(s, r; τ) + γ·ℓ_θ(top) with ℓ the mean over elements."""
    beta, tau, gamma = 6.0, 0.2, 0.5
    g = torch.Generator().manual_seed(1)
    v, x0, eps = (torch.randn(3, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch.tensor([1.4, 2.2, 0.9], dtype=torch.float64)
    r = [0.1, 0.7, 0.4]
    v.requires_grad_(True)
    ell = dsm_loss(v, x0, eps)
    s = gdro_implicit_reward(ell, ref, beta)
    loss, st = gdro_loss(s.view(1, 3), torch.tensor([r], dtype=torch.float64), tau)
    total = loss.sum() + gamma * ell[st["top"][0]]
    total.backward()
    rows = []
    for i in range(3):  # ℓ_i and ∂ℓ_i/∂v_i element by element
        vi, ti = v[i].flatten().tolist(), [e - x for e, x in zip(eps[i].flatten().tolist(), x0[i].flatten().tolist())]
        rows.append((sum((a - b) ** 2 for a, b in zip(vi, ti)) / 4, [2 * (a - b) / 4 for a, b in zip(vi, ti)]))
    s_hand = [-beta * (ell_i - float(ref[i])) for i, (ell_i, _) in enumerate(rows)]
    want, ds = by_hand(s_hand, r, tau)
    assert float(total) == pytest.approx(want + gamma * rows[1][0], rel=1e-12)  # item 1 has the top reward
    grads = [[(ds[i] * -beta + gamma * (i == 1)) * p for p in rows[i][1]] for i in range(3)]
    assert v.grad.flatten(1).tolist() == [pytest.approx(row, rel=1e-10) for row in grads]


def test_the_corrected_score_by_hand():
    # r·(û − 3) + 0.2, û = 1 + 4·artifact for a [0, 1] judge; a missing score stays missing
    got = corrected_score([1.0, 0.5, 0.0, None], [1.0, 0.25, 0.7, 0.9], 0.0, 1.0)
    assert got[:3] == pytest.approx([1.0 * 2.0 + 0.2, 0.5 * -1.0 + 0.2, 0.2], rel=1e-15) and got[3] is None
    assert corrected_score([0.8714], [3.4], 1.0, 5.0) == pytest.approx([0.8714 * 0.4 + 0.2])  # the 1-5 scale as is


# ------------------------------------------------------------------------------------------------- the recipe


def gdro_config(tmp_path, **overrides):
    """The contract test's toy config for trainer gdro: a pool of 4 SDE samples per prompt, k = 2, redness reward."""
    return toy_config(tmp_path, "gdro", **{"train.pool_size": 4, "train.pool_shard_prompts": 1, **overrides})


def test_the_pool_resumes_is_reused_and_refuses_another_config(tmp_path, monkeypatch):
    whole = build_trainer(gdro_config(tmp_path / "whole")).pool  # two shards of one prompt each
    made, real = [], pool_module._make_shard

    def interrupted(path, *args):  # the first shard is written, then the generation stops
        if made:
            raise KeyboardInterrupt
        made.append(path.name)
        real(path, *args)

    cfg = gdro_config(tmp_path / "cut")
    monkeypatch.setattr(pool_module, "_make_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_trainer(cfg)
    assert not json.loads((tmp_path / "cut/runs/pools/toy/manifest.json").read_text())["complete"]
    monkeypatch.setattr(pool_module, "_make_shard", lambda path, *a: (made.append(path.name), real(path, *a)))
    resumed = build_trainer(cfg)
    assert made == ["shard_00000.safetensors", "shard_00001.safetensors"]  # the finished shard is not redone
    assert_same(resumed.pool.rewards, whole.rewards, "rewards")
    assert_same(resumed.pool.x0(1, torch.arange(4)), whole.x0(1, torch.arange(4)), "x0")
    assert (
        resumed.pool.manifest["work"] == whole.manifest["work"]
        and whole.manifest["work"]["work/rollout/forward/policy"] == 16
    )

    work.METER.reset()
    again = build_trainer(gdro_config(tmp_path / "cut", seed=6))  # another seed: the same pool, no forward
    assert not any(key.startswith("work/rollout/") for key in work.METER.metrics()) and made[2:] == []
    first = metered_step(again)  # the pool's recorded work is billed at the first step
    assert first["work/rollout/forward/policy"] == 16
    assert first["perf/offline_s"] == again.pool.manifest["seconds"] and "perf/offline_s" not in metered_step(again)
    with pytest.raises(
        ValueError, match=r"holds a pool made with train.pool_size=4, this run has 3: delete that folder"
    ):
        build_trainer(gdro_config(tmp_path / "cut", **{"train.pool_size": 3}))


def test_resumes_bit_for_bit(tmp_path):
    """Two groups, two minibatches of one group each, two (t, ε) draws: two optimizer steps a step."""
    extra = {"train.num_minibatches": 2, "data.num_prompts_per_step": 2, "train.num_train_timesteps": 2}
    extra |= {"checkpoint.every_n_steps": 1, "train.pool_dir": str(tmp_path / "pool")}
    _, lines, _ = straight_and_resumed(gdro_config, tmp_path, extra)
    assert [line["train/optimizer_steps"] for line in lines] == [2, 4]


def test_two_gloo_processes_match_one_process(tmp_path):
    """Two prompt groups, one on each process; each process makes its share of the pool's shards."""
    extra = {
        "trainer": "gdro",
        "num_steps": 2,
        "model": {"path": "toy", "lora_rank": 4},
        "sampler": {"name": "ode", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
        "data": {"prompts": ["two red circles", "one blue square", "three green triangles"], "num_prompts_per_step": 2},
        "train": {"learning_rate": 3e-3, "pool_size": 4, "pool_shard_prompts": 1, "ema_every_n_steps": 1, "tau": 0.5},
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    extra["data"] |= {"group_size": 3}
    extra["train"] |= {"use_async_rewards": False, "num_train_timesteps": 2}
    runs, lines = one_and_two_processes(tmp_path, write_config(tmp_path, "toy", "one", **extra))
    pools = [json.loads((runs / "pools" / r / "manifest.json").read_text()) for r in ("one", "two")]
    assert pools[0]["work"] == pools[1]["work"]  # the same shards, made by one process or dealt over two
    norms = [[x["train/grad_norm"] for x in run] for run in lines]
    assert min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    assert_same_checkpoints(runs, ("trainable.safetensors", "ema.safetensors"))


def test_the_toy_config_runs(tmp_path):
    lines = toy_config_run(tmp_path, "gdro")
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["train/loss"]) for line in lines) and "perf/offline_s" in lines[0]


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"train.beta=0.0, .* must all be > 0 and tau=0.05, gamma=0.5 >= 0"):
        build_trainer(gdro_config(tmp_path, **{"train.beta": 0.0}))
    with pytest.raises(ValueError, match=r"train.mode='plackett' must be in \('pl', 'top1', 'rank'\)"):
        build_trainer(gdro_config(tmp_path, **{"train.mode": "plackett"}))
    with pytest.raises(ValueError, match=r"data.group_size=5 is gdro's k, .*: set it in \[2, train.pool_size=4\]"):
        build_trainer(gdro_config(tmp_path, **{"data.group_size": 5}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(gdro_config(tmp_path, **{"model.use_lora": False}))
    with pytest.raises(ValueError, match=r"train.num_minibatches=2 must divide the 1 prompt groups each process holds"):
        build_trainer(gdro_config(tmp_path, **{"train.num_minibatches": 2}))
    with pytest.raises(ValueError, match="balancer gd2po asks the trainer for sample_mask, but gdro ranks the raw"):
        build_trainer(gdro_config(tmp_path, **{"balancer": {"name": "gd2po"}}))
