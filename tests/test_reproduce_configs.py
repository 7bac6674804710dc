"""The reproduction configs (configs/reproduce/): each builds as a RunConfig whose rewards are registered and whose
prompt sets are named sets; `flowrl plan` plans each for 8 H100s, and its `# Plan:` header line and its row in
docs/results/reproduce.md hold what the plan computes now (so neither goes stale when the plan or the config changes);
the DiffusionNFT curriculum's stage commands on that page build too."""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from flowrl.config import RunConfig
from flowrl.plan import plan
from flowrl.prompt_sets import parse_prompt_set
from flowrl.registry import REWARDS
from flowrl.trainers import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs" / "reproduce").glob("*.yaml"))
PAGE = REPO / "docs" / "results" / "reproduce.md"
GPU, NUM_GPUS = "h100", 8
# the OCR and PickScore sets load through `datasets` (network once, then its cache); offline, a plan reads the shipped
# samples of the same files instead: a step's work does not depend on the prompts' text (checked below)
SAMPLES = {
    "ocr": REPO / "configs" / "prompts" / "ocr_flowgrpo_sample.txt",
    "pickscore": REPO / "configs" / "prompts" / "pickscore_flowgrpo_sample.txt",
}
HOURS = re.compile(r"(\d+) \((\d+) tuned\)")


def plan_headers():
    """scripts/plan_headers.py, which writes every real config's `# Plan:` line."""
    spec = importlib.util.spec_from_file_location("plan_headers", REPO / "scripts" / "plan_headers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offline_overrides(cfg: RunConfig) -> list[str]:
    """Overrides that swap each prompt set needing the network for the shipped sample of the same file."""
    out = []
    for section in ("data", "eval"):
        spec = getattr(cfg, section).prompt_set
        if spec and parse_prompt_set(spec)[0] in SAMPLES:
            out += [f"{section}.prompt_set=null", f"{section}.prompts_file={SAMPLES[parse_prompt_set(spec)[0]]}"]
    return out


@functools.cache
def planned(path: Path) -> dict:
    return plan.plan(path, GPU, NUM_GPUS, overrides=offline_overrides(load_config(path)))


def page_rows() -> dict[str, str]:
    """{config file name: its table row} of docs/results/reproduce.md's table."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        found = re.search(r"configs/reproduce/([\w.]+\.yaml)", line)
        if line.startswith("|") and found:
            rows[found.group(1)] = line
    return rows


def test_the_published_setups_have_a_config_and_a_row():
    names = {p.name for p in CONFIGS}
    assert names == {
        "flowgrpo_sd3_geneval.yaml",
        "flowgrpo_sd3_ocr.yaml",
        "flowgrpo_sd3_pickscore.yaml",
        "nft_sd3_multireward.yaml",
        "dgpo_sd3_geneval.yaml",
        "elbo_sd3_geneval.yaml",
    }
    assert set(page_rows()) == names
    for row in page_rows().values():
        assert "not yet run on a GPU" in row


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_config_builds_with_registered_rewards_and_named_prompt_sets(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig) and cfg.model.path == "stabilityai/stable-diffusion-3.5-medium"
    assert cfg.data.prompt_set and cfg.eval.prompt_set and not cfg.data.prompts_file
    assert parse_prompt_set(cfg.data.prompt_set)[1] == "train" and parse_prompt_set(cfg.eval.prompt_set)[1] == "test"
    for reward in cfg.rewards:
        assert reward.name in REWARDS, f"{path.name}: reward {reward.name!r} is not registered"
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert header[0].startswith("# Reproduces "), f"{path.name}: the header's first line says what it reproduces"
    launch = f"scripts/train.py --config configs/reproduce/{path.name}"
    assert any(launch in line for line in header), f"{path.name}: the header gives its launch command"


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_the_header_and_the_page_hold_what_the_plan_computes(path):
    result = planned(path)
    headers = plan_headers()
    expected = headers.header_line(path, result, GPU, "none")
    written = [line for line in path.read_text().splitlines() if line.startswith("# Plan:")]
    assert written == [expected], f"stale header; write it again:\n{expected}"
    hours = result["run_gpu_hours"][GPU]
    found = HOURS.search(page_rows()[path.name])
    assert found, f"docs/results/reproduce.md: the row of {path.name} gives 'N (M tuned)' GPU-hours"
    assert (int(found.group(1)), int(found.group(2))) == (round(hours["research"]), round(hours["tuned"])), (
        f"docs/results/reproduce.md: {path.name} plans {hours['research']:.0f} ({hours['tuned']:.0f} tuned) GPU-hours"
    )


@pytest.mark.slow
def test_a_step_does_the_same_work_whatever_the_prompts_say():
    path = REPO / "configs" / "reproduce" / "dgpo_sd3_geneval.yaml"
    sample = REPO / "configs" / "prompts" / "geneval_sample.jsonl"
    swapped = [
        f"{section}.{key}" for section in ("data", "eval") for key in ("prompt_set=null", f"prompts_file={sample}")
    ]
    assert plan.step_work(path, swapped)[0] == plan.step_work(path)[0]


def curriculum_commands() -> list[list[str]]:
    """The launch commands of the page's DiffusionNFT curriculum block, as argument lists."""
    text = PAGE.read_text()
    block = text[text.index("## DiffusionNFT curriculum") :]
    block = block[block.index("```") + 3 :]
    block = block[block.index("\n") + 1 : block.index("```")].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.startswith("accelerate launch")]


def test_the_curriculum_stages_build_and_add_up_to_the_published_length():
    commands = curriculum_commands()
    assert len(commands) == 5
    steps, rewards, first = [], [], None
    for args in commands:
        at = args.index("--config")
        cfg = load_config(REPO / args[at + 1], args[at + 2 :])
        assert cfg.trainer == "nft" and cfg.sampler.kwargs["guidance_scale"] == 1.0
        steps.append(cfg.num_steps)
        rewards.append({r.name for r in cfg.rewards})
        first = first or cfg.rewards
        assert cfg.rewards[: len(first)] == first  # the three preference rewards keep stage 1's weights and settings
    assert steps == [800, 300, 200, 200, 100]  # DiffusionNFT's Appendix C: 1,600 iterations
    three = {"pickscore", "hpsv2", "clipscore"}
    assert rewards == [three, three | {"geneval"}, three, three | {"geneval"}, three | {"ocr"}]
