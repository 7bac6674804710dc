"""How a configured reward runs: `dtype`, `device` and `batch_size` per reward (RewardConfig -> build_rewards), for
every registered reward and in detail for PickScore; PickScore under both transformers return forms of
get_image_features / get_text_features (4.x: a tensor; 5.x: an output with `pooler_output`)."""

from __future__ import annotations

import inspect

import pytest
import torch
import yaml
from tiny_checkpoints import CONTRACT_PROMPTS, REWARD_FACTORIES, contract_metadata, tiny_pickscore

from flowrl.config import ConfigError, RewardConfig, dump_config
from flowrl.registry import REWARDS
from flowrl.trainers import load_config
from flowrl.training.scoring import BatchedReward, build_rewards, score_batch

PROMPTS = ["a red circle", "two blue squares", "a cat", "one green triangle", "a dog"]


def _images(n: int = 5) -> torch.Tensor:
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(0))  # [N, 3, H, W]


def _config(tmp_path, reward: dict, overrides: list[str] | None = None):
    data = {
        "name": "runtime",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "model": {"path": "toy", "lora_rank": 4},
        "data": {"toy_split": "train", "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 2},
        "rewards": [reward],
        "logging": {"trackers": [], "progress_bar": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, overrides)


def test_pickscore_scores_the_same_when_get_features_returns_a_plain_tensor(tmp_path, monkeypatch):
    reward = REWARDS.build("pickscore", **tiny_pickscore(tmp_path))
    expected = reward(_images(), PROMPTS, [{}] * 5).scores
    model = reward.model
    image_features, text_features = model.get_image_features, model.get_text_features
    assert not isinstance(image_features(pixel_values=torch.zeros(1, 3, 32, 32)), torch.Tensor)  # 5.x: an output object
    # transformers 4.57: get_*_features return the projected embeddings as a tensor
    monkeypatch.setattr(model, "get_image_features", lambda **kw: image_features(**kw).pooler_output)
    monkeypatch.setattr(model, "get_text_features", lambda **kw: text_features(**kw).pooler_output)
    torch.testing.assert_close(reward(_images(), PROMPTS, [{}] * 5).scores, expected, atol=0, rtol=0)


def test_reward_config_dtype_builds_bfloat16_weights_that_score(tmp_path):
    cfg = _config(tmp_path, {"name": "pickscore", "dtype": "bf16", **tiny_pickscore(tmp_path / "pick")})
    spec = cfg.rewards[0]
    assert (spec.dtype, spec.kwargs.get("dtype")) == ("bf16", None)  # a run setting, not a constructor kwarg
    reward = build_rewards(cfg.rewards, "cpu")["pickscore"]
    assert {p.dtype for p in reward.model.parameters()} == {torch.bfloat16}
    scores = score_batch({"pickscore": reward}, _images(), PROMPTS, [{}] * 5, "raise").scores["pickscore"]
    full = build_rewards(_config(tmp_path, {"name": "pickscore", **tiny_pickscore(tmp_path / "pick")}).rewards, "cpu")
    assert {p.dtype for p in full["pickscore"].model.parameters()} == {torch.float32}  # default unchanged
    reference = full["pickscore"](_images(), PROMPTS, [{}] * 5).scores
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, reference, atol=0.5, rtol=0.05)  # bf16 rounding of a logit-scaled cosine


def test_reward_config_batch_size_scores_in_chunks_with_the_same_scores(tmp_path):
    kwargs = tiny_pickscore(tmp_path / "pick")
    whole = build_rewards(_config(tmp_path, {"name": "pickscore", **kwargs}).rewards, "cpu")["pickscore"]
    cfg = _config(tmp_path, {"name": "pickscore", "batch_size": 2, "device": "cpu", **kwargs})
    chunked = build_rewards(cfg.rewards, "cpu")["pickscore"].reward  # inside the work meter's wrapper
    sizes = []
    chunked.reward = _Counting(chunked.reward, sizes)  # records the size of each call the chunks make
    assert isinstance(chunked, BatchedReward) and chunked.registry_name == "pickscore" and chunked.differentiable
    out = score_batch({"pickscore": chunked}, _images(), PROMPTS, [{}] * 5, "raise").scores["pickscore"]
    assert sizes == [2, 2, 1]
    torch.testing.assert_close(out, whole(_images(), PROMPTS, [{}] * 5).scores, atol=1e-5, rtol=1e-5)
    assert yaml.safe_load(dump_config(cfg))["rewards"][0]["batch_size"] == 2  # written back to the run's config.yaml
    grads = []
    for reward in (whole, chunked):  # the gradient a differentiable recipe takes flows through the chunks alike
        images = _images().requires_grad_(True)
        reward(images, PROMPTS, [{}] * 5).scores.sum().backward()
        grads.append(images.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_batched_reward_keeps_parts():
    reward = BatchedReward(REWARDS.build("toy_exact"), 2)
    prompts = ["two red circles", "one blue square", "three green triangles"]
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    whole, chunked = REWARDS.build("toy_exact")(images, prompts, [{}] * 3), reward(images, prompts, [{}] * 3)
    assert set(chunked.parts) == set(whole.parts) and chunked.parts
    for key in whole.parts:
        torch.testing.assert_close(chunked.parts[key], whole.parts[key])
    one_by_one = BatchedReward(REWARDS.build("jpeg_compressibility"), 1)
    torch.testing.assert_close(
        one_by_one(images, prompts, [{}] * 3).scores,
        REWARDS.build("jpeg_compressibility")(images, prompts, [{}] * 3).scores,
    )


@pytest.mark.parametrize("name", REWARDS.names())
def test_every_reward_takes_the_run_settings(name, tiny_reward_kwargs, tmp_path):
    """Every registered reward is built with a run's `dtype` and `device` (constructor arguments) and scored in chunks
    of `batch_size` (BatchedReward), with the scores of one call."""
    parameters = inspect.signature(REWARDS.get(name).__init__).parameters
    assert {"device", "dtype"} <= set(parameters), f"{name}: __init__ must take device and dtype"
    kwargs = tiny_reward_kwargs(name) if name in REWARD_FACTORIES else {}
    spec = RewardConfig(name=name, kwargs=kwargs, dtype="fp32", device="cpu", batch_size=2)
    chunked = build_rewards([spec], "cpu")[name]
    assert isinstance(chunked.reward, BatchedReward) and chunked.reward.batch_size == 2
    whole = REWARDS.build(name, device="cpu", dtype=torch.float32, **kwargs)
    shape = (3, 3, 40, 36) if "image" in whole.modalities else (3, 4, 3, 40, 36)
    images = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(0)).float() / 255
    prompts = CONTRACT_PROMPTS.get(name, ['a sign that says "hello"', "a red cube on a table", 'the word "flow"'])
    metadata = contract_metadata(name, 3, tmp_path)
    expected = whole(images, prompts, metadata).scores
    got = chunked(images, prompts, metadata).scores
    torch.testing.assert_close(got.nan_to_num(-123.0), expected.nan_to_num(-123.0), atol=1e-5, rtol=1e-5)


def test_reward_device_cuda_means_this_process_gpu(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(
        REWARDS.get("jpeg_compressibility"), "__init__", lambda self, device="cpu", **kw: seen.append(device)
    )
    specs = _config(tmp_path, {"name": "jpeg_compressibility", "device": "cuda"}).rewards
    build_rewards(specs, torch.device("cuda", 3))  # built on rank 3's GPU, not cuda:0
    build_rewards(_config(tmp_path, {"name": "jpeg_compressibility", "device": "cpu"}).rewards, torch.device("cuda", 3))
    build_rewards(_config(tmp_path, {"name": "jpeg_compressibility"}).rewards, torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 3), torch.device("cpu"), torch.device("cuda", 1)]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rewards.0.dtype=fp8", "rewards.0.dtype='fp8' must be one of float32, fp32, bfloat16, bf16, float16, fp16"),
        ("rewards.0.device=gpu", "rewards.0.device='gpu' is not a device; use cpu, cuda or cuda:N"),
        ("rewards.0.device=3", "rewards.0.device=3 is not a device"),
        ("rewards.0.batch_size=0", "rewards.0.batch_size=0 must be a whole number >= 1"),
        ("rewards.0.batch_size=2.5", "rewards.0.batch_size=2.5 must be a whole number >= 1"),
        ("rewards.0.batch_size=many", "rewards.0.batch_size='many' must be a whole number >= 1"),
    ],
)
def test_bad_reward_runtime_values_are_one_line_errors(tmp_path, override, expected):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, {"name": "jpeg_compressibility"}, [override])
    assert expected in str(info.value) and "\n" not in str(info.value)


class _Counting:
    """Wraps a reward instance, recording the batch size of each call."""

    def __init__(self, reward, sizes):
        self.reward, self.sizes = reward, sizes

    def __getattr__(self, name):
        return getattr(self.reward, name)

    def __call__(self, images, prompts, metadata):
        self.sizes.append(len(prompts))
        return self.reward(images, prompts, metadata)
