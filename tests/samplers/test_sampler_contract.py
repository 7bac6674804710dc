"""The Sampler contract (flowrl/types.py), checked for every registered sampler on the shipped toy model.

Parametrized over `SAMPLERS.names()`, so a sampler added later is covered without editing this file. Each one is
built from its dataclass fields with small sizes (3 steps, the toy's native 32x32) and given a deterministic
`score_fn` (samplers that rank candidates need one; the others ignore it).
"""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from flowrl import sde
from flowrl.models import load_flow_model
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch, Rollout, Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square", "three green triangles"]
SMALL = {"num_steps": 3, "noise_level": 0.8}  # applied where the sampler has the field


@pytest.fixture(scope="module")
def model():
    return load_flow_model("toy")


def mean_brightness(images, prompts, metadata):
    """A deterministic score per image (a stand-in reward for samplers that prune or rank)."""
    return images.float().flatten(1).mean(dim=1)


def field_names(name):
    return {f.name for f in dataclasses.fields(SAMPLERS.get(name))}


def build(name, **overrides):
    names = field_names(name)
    kwargs = {k: v for k, v in {**SMALL, **overrides}.items() if k in names}
    return SAMPLERS.get(name)(**kwargs)


def make_batch(rows=(0, 1, 2)):
    """One sample per group (distinct prompts, group ids and seeds), so any grouping sampler treats each alone."""
    rows = list(rows)
    return PromptBatch([PROMPTS[i] for i in rows], torch.tensor(rows), seeds=torch.tensor([11 + 7 * i for i in rows]))


def rows_of(rollout, group):
    return (rollout.group_ids.cpu() == group).nonzero().flatten()


def sample(sampler, model, batch, step=0):
    rollout = sampler(model, batch, generator=torch.Generator().manual_seed(0), score_fn=mean_brightness, step=step)
    assert isinstance(rollout, Rollout)
    return rollout


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_seed_determinism(model, name):
    sampler = build(name)
    a, b = sample(sampler, model, make_batch()), sample(sampler, model, make_batch())
    assert torch.equal(a.paths(), b.paths())
    assert torch.equal(a.log_probs, b.log_probs)
    assert torch.equal(a.images, b.images)
    assert torch.equal(a.transitions, b.transitions)


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_a_sample_alone_equals_it_inside_a_batch(model, name):
    sampler = build(name)
    whole = sample(sampler, model, make_batch())
    for group in (1, 2):  # the middle and the last sample of the batch
        alone = sample(sampler, model, make_batch([group]))
        mine, theirs = rows_of(alone, group), rows_of(whole, group)
        assert len(mine) == len(theirs) > 0
        torch.testing.assert_close(alone.paths()[mine], whole.paths()[theirs], rtol=0, atol=1e-5)
        torch.testing.assert_close(alone.log_probs[mine], whole.log_probs[theirs], rtol=0, atol=1e-5)
        torch.testing.assert_close(alone.noise_levels[mine], whole.noise_levels[theirs], rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in SAMPLERS.names() if "noise_level" in field_names(n)])
def test_noise_level_zero_is_the_ode_sampler(model, name):
    batch = make_batch()
    zero = sample(build(name, noise_level=0.0), model, batch)
    ode = sample(build("ode"), model, batch)
    assert torch.equal(zero.sigmas.cpu(), ode.sigmas.cpu())
    assert torch.equal(zero.paths(), ode.paths())
    assert torch.equal(zero.images, ode.images)
    assert not zero.log_probs.any() and len(zero.transitions) == 0


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_rescoring_with_the_rollout_weights_gives_the_stored_log_prob_exactly(model, name):
    """Ratio exactly 1: every transition of the table re-scored with the same weights, on the batch the sampler
    stepped (all samples at that step), equals the stored behaviour log-prob bit for bit."""
    r = sample(build(name), model, make_batch())
    if "noise_level" in field_names(name):
        assert len(r.transitions) > 0  # a stochastic sampler has something to check
    sigmas, paths = r.sigmas.to(r.latents.device), r.paths()  # paths [N, T+1, ...] whatever the storage
    for k in sorted(set(r.transitions[:, 1].tolist())):
        x, x_next = paths[:, k], paths[:, k + 1]  # [N, ...]
        n = x.shape[0]
        with torch.no_grad():
            v = model.velocity(x, sigmas[k], r.cond, r.guidance_scale)
            log_prob, kl = sde.rescore_transition(
                r.rule, v, x, x_next, sigmas[k].expand(n), sigmas[k + 1].expand(n), r.noise_levels[:, k]
            )
        assert kl is None
        for i in r.transitions[r.transitions[:, 1] == k, 0].tolist():
            assert log_prob[i].item() == r.log_probs[i, k].item(), (i, k)


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_transition_table_is_every_step_with_positive_std(model, name):
    r = sample(build(name), model, make_batch())
    sigmas, levels = r.sigmas.cpu(), r.noise_levels.cpu()
    n, t = levels.shape
    assert r.paths().shape[:2] == (n, t + 1) and r.log_probs.shape == (n, t) and sigmas.shape == (t + 1,)
    expected = [
        (i, k)
        for i in range(n)
        for k in range(t)
        if float(
            sde.sde_std(
                float(sigmas[k]), float(sigmas[k + 1]), r.rule.kind, float(levels[i, k]), r.rule.first_step_threshold
            )
        )
        > 0
    ]
    table = [tuple(row) for row in r.transitions.tolist()]
    assert len(table) == len(set(table))
    assert sorted(table) == expected
    # deterministic transitions carry no log-prob
    stochastic = torch.zeros(n, t, dtype=torch.bool)
    for i, k in expected:
        stochastic[i, k] = True
    assert not r.log_probs.cpu()[~stochastic].any()


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_the_step_argument_is_accepted(model, name):
    batch = make_batch([0])
    r = sample(build(name), model, batch, step=5)
    assert r.paths().shape[1] == r.num_steps + 1 and r.prompts == batch.prompts


def protocol_members(protocol) -> set[str]:
    """The attributes and methods a Protocol declares (its own and its bases')."""
    out = set()
    for cls in protocol.__mro__:
        if cls is object or cls.__name__ in ("Protocol", "Generic"):
            continue
        out |= set(getattr(cls, "__annotations__", {}))
        out |= {n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__call__")}
    return out


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_every_protocol_member_is_declared(model, name):
    sampler = build(name)
    missing = sorted(m for m in protocol_members(Sampler) if not hasattr(sampler, m))
    assert not missing, f"sampler {name} lacks {missing} of flowrl.types.Sampler"
    steps, stochastic = sampler.trained_steps(model), sampler.trained_steps(model, stochastic_only=True)
    assert steps.dtype == stochastic.dtype == torch.bool and steps.shape == stochastic.shape == (sampler.num_steps,)
    assert not (stochastic & ~steps).any()
    rollout = sample(sampler, model, make_batch())
    assert stochastic[rollout.transitions[:, 1]].all()  # every trainable transition lies on a step it states
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in sampler.rollout_metrics(rollout).items())


def imported_modules(path: Path) -> set[str]:
    """The dotted modules a file imports (relative imports resolved inside flowrl.samplers)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "flowrl.samplers" + (f".{base}" if base else "")
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return out


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_a_sampler_plugin_imports_no_other_plugin(name):
    """The stages samplers share live in private modules (samplers/_rollout.py); a plugin never imports a sibling."""
    path = Path(inspect.getfile(SAMPLERS.get(name)))
    plugins = {f"flowrl.samplers.{p.stem}" for p in path.parent.glob("*.py") if not p.stem.startswith("_")}
    siblings = sorted((imported_modules(path) & plugins) - {f"flowrl.samplers.{path.stem}"})
    assert not siblings, f"samplers/{path.name} imports the plugin(s) {siblings}; move what they share to a _module"
