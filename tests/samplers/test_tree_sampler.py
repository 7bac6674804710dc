"""The tree sampler (samplers/tree.py, BranchGRPO) on the shipped toy model: its forward count, shared prefixes, exact
edge log-probs, chunking, and GRPO training on its edges (rewarded by `Redness`, whose spread is built in)."""

import dataclasses
import math

import pytest
import torch

import flowrl.trainers.grpo as grpo
import flowrl.trainers.kit as kit
from flowrl.models import load_flow_model
from flowrl.registry import SAMPLERS
from flowrl.trainers import build_config
from flowrl.trainers.grpo import GRPOTrainer
from flowrl.trainers.tree_credit import transition_advantages
from flowrl.types import PromptBatch, RewardOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square", "three green triangles"]


@pytest.fixture(scope="module")
def model():
    return load_flow_model("toy")


class OneRowAtATime:
    """The model with its velocity computed one sample per call. On this CPU the toy UNet's kernels round
    differently at batch sizes 1, 2-3, 4-15 and 16+ (oneDNN picks its algorithm by batch size), and a tree's
    training batches (edges of several depths together) never have its sampling frontier's size; one row per
    call gives every forward the same numerics, so what these tests compare is the sampler's and the trainer's
    own arithmetic, exactly."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def velocity(self, latents, sigma, cond, guidance_scale=1.0):
        n = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1).expand(n)
        rows = [{key: value[i : i + 1] for key, value in cond.items()} for i in range(n)]
        return torch.cat(
            [self.model.velocity(latents[i : i + 1], sigma[i : i + 1], rows[i], guidance_scale) for i in range(n)]
        )


class Redness:
    """The training runs' reward: how much redder than green and blue an image is, on average (as
    tests/trainers/redness.py). Two different images score apart, so a tree's leaves have reward spread by
    construction, whatever the toy judges score them (the learned judge can give a tree's four leaves one saturated
    score, and its advantages are then exactly 0)."""

    modalities = ("image",)
    differentiable = True

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput((images[:, 0] - images[:, 1:].mean(1)).mean((1, 2)))  # [N]


REWARD = f"{__name__}.Redness"  # the registries' dotted-path fallback; this module is already imported


def tree(**kw):
    options = dict(num_steps=4, split_steps=(0, 2), branching=2, kind="dance", noise_level=0.5, split_noise_scale=3.0)
    return SAMPLERS.get("tree")(**{**options, **kw})


def batch(num_trees=1, leaves=4, seed=3):
    n = num_trees * leaves
    groups = torch.arange(num_trees).repeat_interleave(leaves)
    return PromptBatch([PROMPTS[int(g) % 3] for g in groups], groups, seeds=torch.arange(n) + seed * 100)


def test_branchgrpo_tree_has_16_leaves_and_costs_203_forwards(model):
    """ALGORITHMS §11 item 10: splits {0, 3, 6, 9}, T = 20, b = 2; the sampler counts the nodes it ran."""
    sampler = tree(num_steps=20, split_steps=(0, 3, 6, 9), noise_level=0.3, split_noise_scale=4.0, decode=False)
    assert sampler.num_leaves == 16
    r = sampler(model, batch(1, 16))
    assert r.paths().shape[:2] == (16, 21) and r.extras["num_trees"] == 1
    assert r.extras["num_forwards"] == 203
    assert r.extras["nodes_per_step"] == (1, 2, 2, 2, 4, 4, 4, 8, 8, 8) + (16,) * 10
    # every stochastic edge once: all edges of steps 0..18 (the last step is Euler), Σ_k nodes(k + 1) = 202
    assert len(r.transitions) == 202 and len({tuple(e) for e in r.transitions.tolist()}) == 202
    assert len({tuple(row.flatten()[:8].tolist()) for row in r.final_latents()}) == 16  # 16 distinct leaves


def test_siblings_share_their_prefix_exactly_and_own_each_edge_once(model):
    r = tree()(model, batch(2))
    paths = r.extras["tree_nodes"]  # [N, T+1]
    for a in range(8):
        for b in range(8):
            if r.group_ids[a] != r.group_ids[b]:
                continue
            shared = int((paths[a] == paths[b]).sum())  # depths 0 .. shared-1 are common nodes
            assert torch.equal(r.latent_index[a, :shared], r.latent_index[b, :shared])  # the same stored states
            if a != b:
                assert shared in (1, 3) and not torch.equal(r.paths()[a, shared], r.paths()[b, shared])
    # edges: 2 + 2 + 4 = 8 per tree over steps 0..2, each in the row of the first leaf below its child
    table = {tuple(e) for e in r.transitions.tolist()}
    assert table == {
        (t * 4 + i, k) for t in (0, 1) for i, k in [(0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (1, 2), (2, 2), (3, 2)]
    }
    assert r.std_scales[0, 0] == 3.0 and r.std_scales[0, 2] == 3.0 and r.std_scales[0, 1] == 1.0


def test_shared_prefixes_are_stored_once_not_per_leaf(model):
    """The rollout's latents are a table of Σ_d nodes(d) states per tree, not leaves x (T + 1): every node once, each
    leaf's path indexing into it, and the trainer's states the nodes of its edges."""
    sampler = tree()  # 4 steps, splits 0 and 2, b = 2: nodes 1, 2, 2, 4, 4 per depth
    r = sampler(model, batch(2))
    assert sampler.nodes_per_depth() == [1, 2, 2, 4, 4]
    assert r.latents.shape == (2 * 13, *r.latents.shape[1:]) and r.latent_index.shape == (8, 5)  # not 8 x 5 = 40
    assert r.latents.untyped_storage().nbytes() == r.latents.numel() * 4  # no larger storage behind the table
    assert sorted(r.latent_index.unique().tolist()) == list(range(26))  # every stored state is some leaf's node
    # depth-major, tree-major within a depth: the row of (depth d, tree t, node j) is
    # 2·Σ_{d'<d} nodes(d') + t·nodes(d) + j
    nodes = r.extras["tree_nodes"]  # [N, T+1] node id within its tree, offset by Σ_{d'<d} nodes(d')
    starts = torch.tensor([0, 1, 3, 5, 9])
    expected = 2 * starts + r.group_ids[:, None] * torch.tensor([1, 2, 2, 4, 4]) + (nodes - starts)
    assert torch.equal(r.latent_index, expected)
    paths = r.paths()  # [N, T+1, ...] materialised on request only
    assert torch.equal(r.states(torch.tensor([5, 2]), torch.tensor([3, 1])), torch.stack([paths[5, 3], paths[2, 1]]))
    assert torch.equal(r.final_latents(), paths[:, -1])
    # rollout chunks concatenate into one table, each chunk's index shifted past the tables before it
    other = sampler(model, batch(2, seed=9))
    both = type(r).concat([r, other])
    assert both.latents.shape[0] == 26 + 26 and torch.equal(both.paths(), torch.cat([paths, other.paths()]))
    assert torch.equal(both.latent_index[8:], other.latent_index + 26)
    with pytest.raises(ValueError, match=r"latent_index has shape \(8, 4\), max 17: it needs shape \(8, 5\)"):
        dataclasses.replace(r, latent_index=r.latent_index[:, :-1])


def dance_log_density(model, r, row, k, std_scale):
    """The per-element mean Gaussian log-density of edge (row, k) under std std_scale·s_k, written here (DanceGRPO's
    step), not with flowrl.sde; and the edge's residual spread in units of s_k."""
    sigma, sigma_next = float(r.sigmas[k]), float(r.sigmas[k + 1])
    x = r.states(torch.tensor([row]), k)
    cond = {key: value[row : row + 1] for key, value in r.cond.items()}
    with torch.no_grad():
        v = model.velocity(x, sigma, cond, r.guidance_scale)
    eta, d_sigma = 0.5, sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + d_sigma * v - 0.5 * eta**2 * score * d_sigma
    s_k = eta * math.sqrt(-d_sigma)
    x_next = r.states(torch.tensor([row]), k + 1)
    spread = float((x_next - mean).pow(2).mean().sqrt()) / s_k
    return torch.distributions.Normal(mean, std_scale * s_k).log_prob(x_next).mean(), spread


@pytest.mark.parametrize("mode", ["scaled", "unscaled"])
def test_edge_log_probs_are_the_gaussian_density_of_split_and_chain_edges(model, mode):
    r = tree(split_log_prob=mode)(model, batch())
    for row, k in r.transitions.tolist():
        split = k in (0, 2)
        scale = 3.0 if split and mode == "scaled" else 1.0
        expected, spread = dance_log_density(model, r, row, k, scale)
        torch.testing.assert_close(r.log_probs[row, k], expected, rtol=1e-5, atol=1e-5)
        assert abs(spread - (3.0 if split else 1.0)) < 0.1  # both modes draw split children with 3·s_k (3072 elements)
    if mode == "scaled":  # re-scoring uses the same scale
        assert r.std_scales[r.transitions[:, 0], r.transitions[:, 1]].tolist().count(3.0) == 6
    else:
        assert r.std_scales is None


def test_a_tree_rollout_is_identical_whatever_the_chunking(model):
    rowwise = OneRowAtATime(model)
    whole, raw = tree()(rowwise, batch(2)), tree()(model, batch(2))
    for size in (1, 3):
        chunked = tree(max_forward_batch=size)(rowwise, batch(2))
        assert chunked.extras["forward_calls"] == sum((n + size - 1) // size for n in whole.extras["nodes_per_step"])
        for field in ("latents", "latent_index", "log_probs", "noise_levels", "std_scales", "images", "transitions"):
            assert torch.equal(getattr(whole, field), getattr(chunked, field)), (size, field)
        # the plain toy model: the same draws and edges, latents equal up to its batch-size rounding
        chunked = tree(max_forward_batch=size)(model, batch(2))
        assert torch.equal(raw.transitions, chunked.transitions)
        torch.testing.assert_close(raw.latents, chunked.latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(raw.log_probs, chunked.log_probs, rtol=0, atol=1e-4)


def test_mix_mode_is_sde_in_the_window_and_at_splits_and_euler_elsewhere(model):
    sampler = tree(num_steps=8, split_steps=(0, 5), use_mix=True, mix_window_size=2, mix_window_stride=4)
    assert sampler.step_noise_levels() == [0.5, 0.5, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]  # k mod 4 < 2, split 5, last Euler
    r = sampler(model, batch())
    assert sorted(set(r.transitions[:, 1].tolist())) == [0, 1, 4, 5]
    assert r.extras["num_forwards"] == 1 + 2 * 5 + 4 * 2  # every node still takes its forward
    # window 0: only the split is stochastic, an Euler prefix and suffix (Flow-GRPO-Fast's single branching point)
    fast = tree(num_steps=6, split_steps=(2,), branching=4, use_mix=True, mix_window_size=0)
    assert fast.step_noise_levels() == [0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    r = fast(model, batch())
    assert r.transitions[:, 1].tolist() == [2, 2, 2, 2] and r.transitions[:, 0].tolist() == [0, 1, 2, 3]
    assert all(torch.equal(r.paths()[0, :3], r.paths()[i, :3]) for i in range(4))


def test_a_split_group_is_refused(model):
    b = batch(1, 4)
    with pytest.raises(ValueError, match="group 0 has 3 samples in this batch but its tree has 4 leaves"):
        tree()(model, b.select([0, 1, 2]))
    with pytest.raises(ValueError, match="split_steps"):
        tree(split_steps=(3,))  # the last step cannot split
    with pytest.raises(ValueError, match="branching"):
        tree(branching=[2])  # one factor for two split steps


def set_dotted(data, overrides):
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = data
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value


def toy_tree_config(tmp_path, **overrides):
    data = {
        "name": "tree",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 2,
        "seed": 3,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS[:2], "num_prompts_per_step": 2, "group_size": 4},
        "sampler": {
            "name": "tree",
            "num_steps": 3,
            "guidance_scale": 1.0,
            "kind": "dance",
            "noise_level": 0.6,
            "split_steps": [0, 1],
            "branching": 2,
            "split_noise_scale": 2.0,
        },
        "rewards": [{"name": REWARD}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {
            "learning_rate": 0.0,
            "clip_range": 1e-2,
            "use_async_rewards": False,
            "use_ema": False,
            "max_grad_norm": 1e9,
            "num_minibatches": 2,
            "num_rollout_batches": 2,
        },
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1, "prompts": PROMPTS[:1]},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


class FSDP2Processes:
    """What GRPOTrainer reads of an accelerator before it builds anything: two FSDP2 processes."""

    num_processes, process_index, is_fsdp2 = 2, 0, True
    distributed_type = type("DistributedType", (), {"name": "FSDP"})


def test_tree_settings_that_cannot_run_are_one_line_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^data.group_size=8 but the tree of sampler.split_steps=\[0, 1\] and "):
        GRPOTrainer(toy_tree_config(tmp_path, **{"data.group_size": 8}))
    with pytest.raises(ValueError, match=r"set data.group_size=4$"):
        GRPOTrainer(toy_tree_config(tmp_path, **{"data.group_size": 2}))
    with pytest.raises(
        ValueError, match=r"num_rollout_batches=4 makes rollout chunks of 2 samples, which splits a tree"
    ):
        GRPOTrainer(toy_tree_config(tmp_path, **{"train.num_rollout_batches": 4, "train.num_minibatches": 4}))
    one_chunk = {"train.num_rollout_batches": 1, "train.num_minibatches": 1}  # one tree per process
    sharded = toy_tree_config(tmp_path, **{"train.tree.width_pruning": "per_branch", **one_chunk})
    with pytest.raises(
        ValueError, match=r"width_pruning='per_branch' prunes each process's edges .* set it to 'none'$"
    ):
        GRPOTrainer(sharded, accelerator=FSDP2Processes())


def randomize_adapter(trainer):
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("rowwise", [True, False], ids=["one-row-forwards", "batched-forwards"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_policy_ratio_of_every_edge_is_exactly_one(tmp_path, monkeypatch, precision, rowwise):
    trainer = GRPOTrainer(toy_tree_config(tmp_path, **{"model.mixed_precision": precision, "train.kl_coef": 0.1}))
    randomize_adapter(trainer)
    if rowwise:
        trainer.parts.model = OneRowAtATime(trainer.parts.model)
    seen = {}
    original = grpo.grpo_optimise

    def optimise(parts, rollout, advantages, keep, *rest, **kwargs):
        seen["credit"] = transition_advantages(rollout, advantages, keep, parts.cfg.train.tree, parts.step, 2)
        return original(parts, rollout, advantages, keep, *rest, **kwargs)

    monkeypatch.setattr(grpo, "grpo_optimise", optimise)
    metrics = trainer.train_step()
    assert metrics["train/zero_std_fraction"] == 0.0, metrics  # the reward tells every tree's leaves apart
    if rowwise:
        assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0, metrics
        assert metrics["train/approx_kl"] == 0.0
    else:  # training batches mix depths, so their size differs from the frontier's: the toy UNet rounds apart
        assert abs(metrics["train/ratio_min"] - 1) <= 1e-6 and abs(metrics["train/ratio_max"] - 1) <= 1e-6, metrics
    credit = seen["credit"]
    assert len(credit.transitions) == 2 * (2 + 4)  # two trees, edges of steps 0 and 1 (step 2 is Euler)
    assert credit.advantages.abs().sum() > 0  # depth-wise advantages carry signal


def test_a_grpo_step_on_tree_edges_moves_the_weights_and_resumes_identically(tmp_path):
    cfg = toy_tree_config(tmp_path / "a", **{"train.learning_rate": 1e-2, "checkpoint.every_n_steps": 1})
    straight = GRPOTrainer(cfg)
    before = [p.detach().clone() for p in straight.parts.opt.params]
    kit.train(straight)
    assert any(not torch.equal(a, b) for a, b in zip(before, straight.parts.opt.params))
    # interrupted after step 1, resumed for step 2
    kit.train(GRPOTrainer(toy_tree_config(tmp_path / "b", **{"train.learning_rate": 1e-2, "num_steps": 1})))
    resumed = GRPOTrainer(
        toy_tree_config(
            tmp_path / "b",
            **{"train.learning_rate": 1e-2, "checkpoint.resume": "latest", "checkpoint.every_n_steps": 1},
        )
    )
    kit.train(resumed)
    for a, b in zip(straight.parts.opt.params, resumed.parts.opt.params):
        assert torch.equal(a, b)
