"""The candidates sampler's preview precision against the run's device, decided when the config loads and before any
model does: `auto` chooses (and says so), a kernel the device lacks is a one-line ConfigError. A fake CUDA device
(torch.cuda's answers patched) stands in for Hopper (sm_90) and Blackwell (sm_100)."""

from pathlib import Path

import pytest
import torch

import flowrl.models
from flowrl import quant
from flowrl.config import ConfigError
from flowrl.models import load_flow_model
from flowrl.quant import PreviewSpec, build_preview
from flowrl.trainers import build_trainer, load_config

ROOT = Path(__file__).resolve().parents[1]
SOLRL = ["configs/sd3/solrl.yaml", "configs/flux/solrl.yaml", "configs/sana/solrl.yaml"]


def overrides(path: str, *extra: str) -> list[str]:
    prompts = {"configs/sd3": "pickscore", "configs/flux": "hpd", "configs/sana": "pickscore"}[str(Path(path).parent)]
    return [f"data.prompts_file={ROOT / 'configs' / 'prompts' / f'{prompts}_sample.txt'}", *extra]


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((9, 0)): this machine has a CUDA device of that capability, with torchao installed (or not)."""

    def install(capability, torchao=True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(quant, "torchao_installed", lambda: torchao, raising=False)

    return install


@pytest.fixture
def loads(monkeypatch):
    """The model loads attempted: a loader that records and refuses."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a model loaded")

    monkeypatch.setattr(flowrl.models, "_load", refuse)
    return calls


@pytest.mark.parametrize("path", SOLRL)
def test_explicit_nvfp4_on_a_hopper_is_refused_when_the_config_loads(path, fake_gpu, loads):
    fake_gpu((9, 0))
    expected = (
        r"preview_backend='nvfp4' needs torchao kernels on an sm_100\+ GPU; "
        r"this run has an sm_90 GPU: use auto \(fp8 here\) or fp8$"
    )
    with pytest.raises(ConfigError, match=expected):
        build_trainer(load_config(ROOT / path, overrides(path, "sampler.preview_backend=nvfp4+few_step")))
    assert loads == []  # refused before any model load (the trainer never started)


@pytest.mark.parametrize(
    "capability, chosen",
    [((9, 0), "fp8 on sm_90 (torchao kernels)"), ((8, 9), "fp8 on sm_89"), ((10, 0), "nvfp4 on sm_100")],
)
def test_auto_chooses_the_kernels_of_the_gpu_and_says_so(capability, chosen, fake_gpu, capsys):
    fake_gpu(capability)
    cfg = load_config(ROOT / SOLRL[0], overrides(SOLRL[0]))
    assert cfg.sampler.kwargs["preview_backend"] == "auto+few_step"  # the config stays free of hardware
    assert f"sampler.preview_backend=auto+few_step: auto runs previews at {chosen}" in capsys.readouterr().err


def test_auto_on_the_cpu_is_the_exact_emulation(capsys):
    for path in SOLRL:
        load_config(ROOT / path, overrides(path, "device=cpu"))
        assert "auto runs previews at fake_nvfp4 on the CPU (exact emulation" in capsys.readouterr().err


def test_fp8_without_torchao_or_on_an_older_gpu_is_refused_when_the_config_loads(fake_gpu, loads):
    fake_gpu((9, 0), torchao=False)
    with pytest.raises(
        ConfigError, match=r"preview_backend='auto' runs fp8 through torchao, which is not installed: pip install"
    ):
        load_config(ROOT / SOLRL[1], overrides(SOLRL[1]))
    fake_gpu((8, 0))  # an A100: no float8 kernels
    with pytest.raises(
        ConfigError,
        match=(
            r"'fp8' needs torchao kernels on an sm_89\+ GPU; "
            r"this run has an sm_80 GPU: use auto \(fake_nvfp4 here\) or fake_fp8"
        ),
    ):
        load_config(ROOT / SOLRL[2], overrides(SOLRL[2], "sampler.preview_backend=fp8+few_step"))
    with pytest.raises(
        ConfigError, match=r"'nvfp4' needs .* this run has the CPU: use auto \(fake_nvfp4 here\) or fake_nvfp4"
    ):
        load_config(ROOT / SOLRL[0], overrides(SOLRL[0], "device=cpu", "sampler.preview_backend=nvfp4"))
    assert loads == []


def test_auto_resolves_per_device(fake_gpu):
    resolve_precision = quant.resolve_precision
    assert resolve_precision("auto", "cpu") == "fake_nvfp4" and resolve_precision("fake_fp8", "cuda") == "fake_fp8"
    for capability, precision in (
        ((7, 5), "fake_nvfp4"),
        ((8, 9), "fp8"),
        ((9, 0), "fp8"),
        ((10, 0), "nvfp4"),
        ((12, 0), "nvfp4"),
    ):
        fake_gpu(capability)
        assert resolve_precision("auto", "cuda") == precision, capability


def test_auto_on_the_cpu_builds_the_fake_nvfp4_preview_bit_for_bit():
    from flowrl.samplers.candidates import previewing

    model = load_flow_model("toy")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    cond = model.encode(["two red circles", "one blue square"])
    velocities = []
    for precision in ("auto", "fake_nvfp4"):
        preview = build_preview(model.transformer, PreviewSpec([precision]))
        assert sum(type(m).__name__ == "FakeQuantLinear" for m in preview.modules()) > 0
        with previewing(model, preview), torch.no_grad():
            velocities.append(model.velocity(x, torch.tensor(0.6), cond))
    assert torch.equal(*velocities)


def test_the_torchao_configs_exist():
    """torchao's names for the real fp8 / nvfp4 linears (the installed 0.18 API; skipped without torchao)."""
    pytest.importorskip("torchao")
    assert type(quant._torchao_config("fp8")).__name__ == "Float8DynamicActivationFloat8WeightConfig"
    assert type(quant._torchao_config("nvfp4")).__name__ == "NVFP4DynamicActivationNVFP4WeightConfig"
