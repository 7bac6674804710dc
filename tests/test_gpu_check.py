"""scripts/gpu_check.py and scripts/gpu_run.sh: every section passes at tiny size on the CPU from a copy of the tree
that is not installed, the budgets fit the cap, the run script fits one device command, and the real-size parts the
check builds on a GPU (architectures, the loader stand-in, PickScore's ViT-H-14) build on the meta device with the
published sizes.

The un-installed runs use a Python made here: a venv of the base interpreter whose only packages are links to this
interpreter's distributions, filtered (`python_with`); the site-packages' .pth files do not run, so the editable
install's finder for flowrl is not there."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}

# the device image's Python packages (its documentation's list, 2026-11-17): the dry run of gpu_run.sh has these and
# the carried wheels, nothing else (the nvidia-* and cuda-* libraries torch loads are in it too)
DEVICE_IMAGE = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
    charset-normalizer click cloudpickle colorama contourpy cycler filelock flatbuffers fonttools frozenlist fsspec
    grpcio h11 hf-xet httpcore httpx huggingface-hub idna imageio jinja2 joblib kiwisolver markdown markdown-it-py
    markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja numpy onnx onnxruntime
    opencv-python-headless packaging pandas pillow pip pluggy propcache protobuf psutil py-cpuinfo pygments pyparsing
    python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece setuptools six sympy tensorboard
    tensorboard-data-server timm tokenizers torch torchvision tqdm transformers triton typing-extensions urllib3
    werkzeug wheel yarl zipp""".split()
)
ALIASES = {"httpx2": "httpx", "httpcore2": "httpcore"}  # this machine's builds of the image's packages
MACHINE_EXTRAS = {"truststore"}  # what this machine's huggingface_hub 2.x imports (the image's 1.33 does not)


def normalized(name: str) -> str:
    name = re.sub(r"[-_.]+", "-", name).lower()
    return ALIASES.get(name, name)


def python_with(tmp: Path, keep) -> str:
    """A Python whose packages are this interpreter's distributions for which keep(normalized name) holds."""
    site, farm, venv = Path(sysconfig.get_paths()["purelib"]), tmp / "site", tmp / "venv"
    farm.mkdir(parents=True)
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if not keep(normalized(dist.metadata["Name"])):
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (site / top).exists() and not (farm / top).exists():
                (farm / top).symlink_to(site / top)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([python, "-c", query], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "packages.pth").write_text(f"{farm}\n")
    return python


def copy_of_tree(dest: Path) -> Path:
    """The files the device machine gets: tracked and untracked files that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture
def scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))


def test_budgets_add_up_to_less_than_the_cap_and_name_every_section(scripts_on_path):
    import _gpu_sections as sections
    import gpu_check

    assert sum(gpu_check.SECTIONS.values()) < gpu_check.TOTAL_BUDGET
    assert list(gpu_check.SECTIONS)[:2] == ["preview_speed", "sd3_eta"]  # the most value per second first
    assert set(gpu_check.SECTIONS) == set(sections.FUNCTIONS) == set(gpu_check.HEADLINES)
    assert gpu_check.TOTAL_BUDGET + 30 <= 520  # gpu_run.sh's limit holds the cap, the plan's wait and the exit


def test_a_section_over_its_budget_is_stopped_even_inside_a_broad_except(scripts_on_path):
    """The budget's exception is not an Exception: a section's own `except Exception` (one reward model of several)
    cannot swallow it and run on unbounded."""
    import types

    import gpu_check

    def swallowing(ctx):
        try:
            time.sleep(30)
        except Exception:  # noqa: BLE001 - what a section does around one of its parts
            pass
        return {"ok": True}

    result = gpu_check.run_section("slow", swallowing, types.SimpleNamespace(shared={}), 1.0)
    assert not result["ok"] and result["error"] == "SectionTimeout: over its time budget of 1 s"
    assert result["seconds"] < 10


def test_the_real_batches_are_valid_configs(scripts_on_path):
    """Every section's real-size batch loads as its config (what the GPU run and `flowrl plan` read)."""
    import _gpu_sections as sections

    from flowrl.trainers import load_config

    for name in sections.FUNCTIONS:
        job = sections.plan_job(name, tiny=False)
        if job is not None:
            cfg = load_config(ROOT / job[0], job[1])
            assert cfg.data.num_prompts_per_step == 1 and cfg.data.group_size >= 2, name


def test_eta_is_the_counted_work_over_the_measured_seconds(tmp_path, scripts_on_path):
    """η of a phase by hand: rollout forwards x one forward's TFLOP (counted on meta) / (H100 peak x seconds); and the
    plan ratio: the train peak over the plan's total less its overhead."""
    import _gpu_sections as sections

    from flowrl.plan import cost

    ctx = sections.Context(False, torch.device("cpu"), tmp_path)
    step = {"work/rollout/forward/policy": 180.0, "perf/rollout_s": 2.0, "perf/reward_s": 0.0, "perf/optimise_s": 0.0}
    step["perf/step_s"] = 4.0
    eta = sections.eta_per_phase(ctx, sections.SD3_YAML, sections.SD3_REAL, step)
    forward = cost.transformer_forward("sd3.5-medium", 512, 512, None, 333).tflops  # 77 CLIP + 256 T5 tokens
    assert eta["eta"]["rollout"] == pytest.approx(180 * forward / (989.0 * 2.0), rel=1e-9)
    assert eta["eta"]["step"] == pytest.approx(180 * forward / (989.0 * 4.0), rel=1e-9)
    assert set(eta["eta"]) == {"rollout", "step"}  # no seconds measured, no η
    plan = {"rows": 18, "peak_GiB": {"total": 13.0, "overhead": 3.0, "activations": 1.5, "transient": 0.5}}
    compared = sections.compare_with_plan({"peak_GiB": {"train": 12.5}, "activation_peak_GiB": 3.0}, plan)
    assert compared["train_over_plan"] == pytest.approx(1.25) and compared["activations_over_plan"] == pytest.approx(
        1.5
    )


def test_the_run_script_fits_one_device_command():
    """The device tool runs one command of at most 2000 characters: the script is that command."""
    text = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert len(text) <= 2000, len(text)
    assert "--no-index --no-deps" in text and "--target" in text and "timeout -k 15 520" in text


@pytest.mark.slow
def test_tiny_run_from_an_uninstalled_copy_passes_every_section(tmp_path):
    """The tree copied as the device machine gets it, run by a Python in which flowrl is not installed: the check
    imports the package from the checkout itself (flowrl.rewards and flowrl.samplers included)."""
    python = python_with(tmp_path / "python", lambda name: name != "flowrl")
    tree, out = copy_of_tree(tmp_path / "tree"), tmp_path / "out"
    probe = subprocess.run([python, "-c", "import flowrl"], cwd=tmp_path, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'flowrl'" in probe.stderr  # nothing installed to fall back on
    command = [python, "scripts/gpu_check.py", "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, cwd=tree, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["sections.json", "summary.json"]
    results, summary = json.loads((out / "sections.json").read_text()), json.loads((out / "summary.json").read_text())
    assert summary["all_ok"] and list(summary["sections"]) == list(results)
    for name, result in results.items():
        assert result["ok"], (name, result.get("error"), result.get("traceback_tail"))
    for step in results["sd3_grpo"]["steps"]:
        assert step["first_pass_transitions"] > 0
        assert step["first_pass_ratio_min"] == 1.0 and step["first_pass_ratio_max"] == 1.0
        assert step["work/train/backward/lora"] > 0 and step["perf/optimise_s"] > 0
    grpo = results["sd3_grpo"]
    assert set(grpo["eta"]["eta"]) == {"rollout", "score", "train", "step"}
    assert all(v > 0 for v in grpo["eta"]["eta"].values())
    plan = grpo["plan"]["plan_peak_GiB"]  # the plan's estimate, beside the (CPU: absent) measured peaks
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"))
    resume = results["sd3_resume"]
    assert resume["bitwise_equal"] and resume["max_abs_difference"] == 0.0 and resume["step_after_resume"] == 2
    assert resume["deterministic"] and resume["nondeterministic_ops"] == []
    fsdp = results["sd3_fsdp"]
    assert fsdp["sharding"] == "fsdp" and fsdp["bitwise_equal"]
    for name in ("sd3_nft", "sd3_awm"):
        assert results[name]["step"]["work/train/backward/lora"] > 0, name
    for name in ("flux_step", "wan_step", "wan22_step"):
        assert results[name]["step"]["first_pass_ratio_exactly_1"], name
    for name in ("sd3_loader", "flux_step", "wan_step"):  # the real architectures, counted on meta
        assert results[name]["real_size_on_meta"]["transformer_matches_costs_md"], name
    assert results["sd3_eta"]["train_tflop"] > 2 * results["sd3_eta"]["forward_tflop"]  # backward + recompute
    assert results["sd3_eval"]["images"] == 4 and results["sd3_eval"]["seconds_per_image"] > 0
    for reward in ("pickscore", "hpsv2", "imagereward", "hpsv3"):
        assert results["reward_models"][reward]["finite"], reward
    preview = results["preview_speed"]
    assert "fake_fp8" in preview["ran"] and not preview["fp8_real"] and not preview["fp8_asked"]
    assert "error" in preview["formats"]["fp8"]  # real FP8 needs an sm_89+ GPU: said, not hidden


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path):
    """sd3_resume without sd3_grpo's checkpoint fails with one line; real FP8 asked for on a CPU fails as such, with
    the emulation not standing in for it; the run goes on and exits 1."""
    out = tmp_path / "gpu_check"
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    command += ["--sections", "sd3_resume,preview_speed,wan22_step", "--require-fp8"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    results = json.loads((out / "sections.json").read_text())
    assert not results["sd3_resume"]["ok"] and results["sd3_resume"]["error"].startswith(
        "RuntimeError: needs section sd3_grpo"
    )
    preview = results["preview_speed"]
    assert not preview["ok"] and preview["fp8_asked"] and not preview["fp8_real"] and "fake_fp8" in preview["ran"]
    assert preview["error"].startswith("real FP8 was asked for and did not run: ")
    assert results["wan22_step"]["ok"]
    assert not json.loads((out / "summary.json").read_text())["all_ok"]


def test_without_diffusers_each_section_says_so_in_the_json(tmp_path):
    """No bare traceback where a package is missing: the machine names it, each section that needs it fails with the
    import error, the JSON is written."""
    python = python_with(tmp_path / "python", lambda name: name not in ("flowrl", "diffusers"))
    out = tmp_path / "out"
    command = [python, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    command += ["--sections", "sd3_loader,prompt_cache"]
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["diffusers"] == "missing"
    for name, line in summary["sections"].items():
        assert line["error"] == "ModuleNotFoundError: No module named 'diffusers'", (name, line)


@pytest.mark.slow
@pytest.mark.skipif(not any((ROOT / "gpu_wheels").glob("*.whl")), reason="no gpu_wheels/: fetch them (docs/gpu.md)")
def test_the_run_script_dry_run_with_the_carried_wheels(tmp_path):
    """scripts/gpu_run.sh with --tiny --device cpu swapped in, from a copy of the tree, by a Python with the device
    image's packages only: the carried wheels install into a target folder and the sections that import them pass."""
    image = DEVICE_IMAGE | MACHINE_EXTRAS
    python = python_with(tmp_path / "python", lambda name: name in image or name.startswith(("nvidia-", "cuda-")))
    missing = subprocess.run([python, "-c", "import diffusers"], cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'diffusers'" in missing.stderr  # the image lacks it: the wheels bring it
    tree, out = copy_of_tree(tmp_path / "tree"), tmp_path / "out"
    shutil.copytree(ROOT / "gpu_wheels", tree / "gpu_wheels")
    sections = "preview_speed,sd3_grpo,sd3_resume,reward_models"
    env = {**os.environ, **ENV, "OUT": str(out), "PYTHON": python, "GPU_SITE": str(tmp_path / "site")}
    env["GPU_CHECK_ARGS"] = f"--tiny --device cpu --sections {sections}"
    done = subprocess.run(
        ["bash", "scripts/gpu_run.sh"], cwd=tree, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "gpu_check.tar.gz", "sections.json", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["all_ok"] and list(summary["sections"]) == sections.split(",")
    assert summary["machine"]["diffusers"] == "0.42.1" and summary["machine"]["torchao"] == "0.18.0"


def test_real_size_sd3_goes_through_the_loader_on_meta(tmp_path, scripts_on_path):
    """Section sd3_loader's real-size path without memory: the random SD3.5-M pipeline (full text encoders) through
    build_policy on the meta device: fp16 frozen weights, float32 LoRA, gradient checkpointing."""
    import _gpu_archs as archs
    import _gpu_sections as sections

    from flowrl.registry import REWARDS

    meta = torch.device("meta")
    restore = archs.install_factories(meta, tmp_path / "built")
    try:
        result = sections.sd3_loader(sections.Context(False, meta, tmp_path))
        reward = REWARDS.get("pickscore")(device="meta", **sections.pickscore(sections.Context(False, meta, tmp_path)))
    finally:
        restore()
    assert result["ok"], result
    assert result["frozen_transformer_dtypes"] == ["torch.float16"]
    params = result["real_size_on_meta"]["params_B"]
    assert params["text_encoder_3"] == pytest.approx(4.76, abs=0.01)  # T5-XXL encoder
    assert params["text_encoder_2"] == pytest.approx(0.69, abs=0.01)  # CLIP-G
    assert sum(p.numel() for p in reward.model.parameters()) / 1e9 == pytest.approx(0.99, abs=0.01)  # ViT-H-14


def test_real_size_hpsv3_builds_on_meta(tmp_path, scripts_on_path):
    """reward_models' HPSv3 at real size without memory: the release's loader fills Qwen2-VL-7B from the random
    checkpoint the check makes in place of the 16 GB file."""
    import _gpu_archs as archs

    from flowrl.registry import REWARDS

    with archs.reward_weights("hpsv3", tmp_path / "hpsv3", torch.device("meta"), tiny=False) as kwargs:
        reward = REWARDS.build("hpsv3", device="meta", **kwargs)
    params = sum(p.numel() for p in reward.model.parameters()) / 1e9
    assert params == pytest.approx(
        7.75, abs=0.05
    )  # Qwen2-VL-7B without its LM head: 7.07 B language model + 0.68 B vision


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_real_architectures_match_the_cost_tables(tmp_path, scripts_on_path, family):
    import _gpu_archs as archs

    counts = archs.count_params(family, tmp_path)
    assert counts["transformer_matches_costs_md"], counts
