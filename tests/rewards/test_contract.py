"""One contract test over every registered reward (flowrl/reward_contract.py), on tiny random weights in the
official checkpoint formats, loaded by each plugin's own loading code."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import CONTRACT_PROMPTS, REWARD_FACTORIES, contract_metadata

from flowrl.registry import REWARDS
from flowrl.types import RewardOutput

PROMPTS = ['a sign that says "hello"', "a red cube on a table", 'the word "flow"']


def _build(name: str, tiny_reward_kwargs):
    if name in REWARD_FACTORIES:
        return REWARDS.build(name, device="cpu", dtype=torch.float32, **tiny_reward_kwargs(name))
    if name.startswith("toy_"):
        try:
            return REWARDS.build(name, device="cpu", dtype=torch.float32)
        except FileNotFoundError as err:  # the toy judges' weights are tracked in git: missing is a bug
            pytest.fail(f"{name}: shipped weights missing: {err}")
    pytest.fail(
        f"reward {name!r} has no tiny-checkpoint factory; add one to tests/rewards/conftest.py REWARD_FACTORIES"
    )


def _inputs(reward, n: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    shape = (n, 3, 40, 36) if "image" in reward.modalities else (n, 4, 3, 40, 36)
    return torch.randint(0, 256, shape, generator=generator).float() / 255  # k/255 values survive PNG transport


@pytest.mark.parametrize("name", REWARDS.names())
def test_reward_contract(name, tiny_reward_kwargs, tmp_path):
    cls = REWARDS.get(name)
    assert isinstance(cls.modalities, tuple) and set(cls.modalities) <= {"image", "video"} and cls.modalities
    assert isinstance(cls.differentiable, bool)
    assert isinstance(getattr(cls, "extra_requires", None), tuple)
    _check_contract(_build(name, tiny_reward_kwargs), name, tmp_path)


def test_ocr_tesseract_backend_contract(require_program, tmp_path):
    """The default ocr backend (rapidocr) runs in test_reward_contract; the tesseract one here, where installed."""
    require_program("tesseract", "apt-get install -y tesseract-ocr")
    reward = REWARDS.build("ocr", device="cpu", dtype=torch.float32, backend="tesseract")
    assert reward.extra_requires == ("pytesseract",)
    _check_contract(reward, "ocr", tmp_path)


def _check_contract(reward, name: str, tmp_path) -> None:
    images = _inputs(reward)
    prompts = CONTRACT_PROMPTS.get(name, PROMPTS)
    metadata = contract_metadata(name, len(prompts), tmp_path)

    out = reward(images, prompts, metadata)
    assert isinstance(out, RewardOutput)
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32 and out.scores.device.type == "cpu"
    assert not torch.isinf(out.scores).any()
    assert not out.scores.requires_grad, "scores carry a graph although the images do not require grad"
    again = reward(images, prompts, metadata).scores
    assert torch.equal(torch.nan_to_num(again, nan=-123.0), torch.nan_to_num(out.scores, nan=-123.0)), (
        "not deterministic"
    )

    if reward.differentiable:
        leaf = images.clone().requires_grad_(True)
        scores = reward(leaf, prompts, metadata).scores
        assert scores.requires_grad
        scores.nansum().backward()
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all() and leaf.grad.abs().sum() > 0


@pytest.mark.parametrize("name", [n for n in REWARDS.names() if n in REWARD_FACTORIES])
def test_reward_rejects_bad_input(name, tiny_reward_kwargs):
    reward = _build(name, tiny_reward_kwargs)
    images = _inputs(reward, n=2)
    prompts, metadata = PROMPTS[:2], [{}, {}]
    with pytest.raises(ValueError, match="shape"):
        reward(images[0], prompts, metadata)
    with pytest.raises(ValueError, match="dtype"):
        reward((images * 255).to(torch.uint8), prompts, metadata)
    with pytest.raises(ValueError, match="range"):
        reward(images * 2 - 1, prompts, metadata)
    with pytest.raises(ValueError, match="empty"):
        reward(images[:0], [], [])
    with pytest.raises(ValueError, match="prompts"):
        reward(images, PROMPTS[:1], metadata)
    with pytest.raises(ValueError, match="prompts is empty|empty"):
        reward(images, [], metadata)


DIFFERENTIABLE = [n for n in REWARDS.names() if n in REWARD_FACTORIES and REWARDS.get(n).differentiable]


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradient_matches_finite_difference(name, tiny_reward_kwargs, tmp_path):
    """Directional derivative from autograd vs a central difference, in float64, through the resize path."""
    reward = REWARDS.build(name, dtype=torch.float64, **tiny_reward_kwargs(name))
    assert reward.differentiable
    generator = torch.Generator().manual_seed(0)
    shape = (2, 3, 40, 36) if "image" in reward.modalities else (2, 4, 3, 40, 36)
    images = (0.25 + 0.5 * torch.rand(shape, generator=generator, dtype=torch.float64)).requires_grad_(True)
    direction = torch.randn(shape, generator=generator, dtype=torch.float64)
    metadata = contract_metadata(name, 2, tmp_path)
    score = lambda x: reward(x, PROMPTS[:2], metadata).scores.sum()  # noqa: E731
    (grad,) = torch.autograd.grad(score(images), images)
    eps = 1e-3  # scores are float32 by contract; the float64 graph inside keeps the difference accurate
    with torch.no_grad():
        numeric = (score(images + eps * direction) - score(images - eps * direction)) / (2 * eps)
    analytic = float((grad * direction).sum())
    assert abs(float(numeric)) > 1e-3, "degenerate check: the score does not depend on the images"
    assert analytic == pytest.approx(float(numeric), rel=2e-3, abs=1e-5)


@pytest.mark.parametrize("name", [n for n in REWARDS.names() if n in REWARD_FACTORIES and n not in ("ocr", "remote")])
def test_reward_runs_in_bfloat16(name, tiny_reward_kwargs, tmp_path):
    """Models in bfloat16 (flowrl score --dtype bfloat16): scores stay float32 [N] and near the float32 ones."""
    kwargs = tiny_reward_kwargs(name)
    images = _inputs(REWARDS.get(name))
    prompts = CONTRACT_PROMPTS.get(name, PROMPTS)
    metadata = contract_metadata(name, 3, tmp_path)
    full = REWARDS.build(name, dtype=torch.float32, **kwargs)(images, prompts, metadata).scores
    half = REWARDS.build(name, dtype=torch.bfloat16, **kwargs)(images, prompts, metadata).scores
    assert half.dtype == torch.float32 and half.shape == (3,)
    torch.testing.assert_close(half, full, atol=0.1 * (1 + float(full.abs().max())), rtol=0)
