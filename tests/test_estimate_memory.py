"""scripts/estimate_memory.py: its parameter counts, its arithmetic, and the estimate lines in the configs' headers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "scripts" / "estimate_memory.py")
em = sys.modules["estimate_memory"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(em)

REAL = sorted(
    p
    for p in (ROOT / "configs").rglob("*.yaml")
    if p.relative_to(ROOT / "configs").parts[0] not in ("toy", "accelerate", "prompts")
)


@pytest.mark.parametrize("arch, expected", [("sd3", 2.243), ("flux", 11.901), ("wan", 1.419)])
def test_transformer_params_match_costs_md(arch, expected):
    assert em.counted(arch)["transformer"] == pytest.approx(expected, rel=0.01)


def test_tiny_case_by_hand():
    fam = em.Family("tiny-model", hidden=64, layers=2, px_per_token=16, text_tokens=8, transformer_b=1.0,
                    encoders_b=0.5, vae_b=0.25, source="a test")  # fmt: skip
    em.FAMILIES.insert(0, fam)
    try:
        cfg = SimpleNamespace(
            trainer="nft",
            model=SimpleNamespace(path="org/tiny-model", dtype="bfloat16", use_lora=True, lora_rank=4, train_expert=None,
                                  use_gradient_checkpointing=True, max_sequence_length=None, offload_text_encoders=False),
            data=SimpleNamespace(num_prompts_per_step=4, group_size=4),
            train=SimpleNamespace(num_minibatches=2, num_rollout_batches=1),
            sampler=SimpleNamespace(kwargs={"height": 64, "width": 64, "guidance_scale": 1.0}),
            rewards=[SimpleNamespace(name="pickscore", kwargs={})],
        )  # fmt: skip
        e = em.estimate(cfg, num_gpus=2)
    finally:
        em.FAMILIES.remove(fam)
    gib = 1024**3
    toks = 4 * 4 + 8  # (64/16)^2 image tokens + 8 text tokens
    lora = 4 * 4 * 2 * 64 * 2  # rank x 4 projections x (in + out) x layers
    rows = 16 // 2 // 2  # 8 samples per GPU in 2 minibatches, no CFG
    act = (2 * 2 + 34) * toks * rows * 64  # checkpointing: 2 bytes/layer kept x 2 layers + one layer's 34
    rollout = 34 * toks * 8 * 64  # the no-grad rollout of all 8 samples: one layer's activations at a time
    parts = {
        "transformer": 2e9 / gib,
        "trainable": lora * 16 / gib,
        "encoders": 1e9 / gib,
        "vae": 0.5e9 / gib,
        "rewards": 0.99e9 * 2 / gib,
        "activations": max(act, rollout) / gib,
        "overhead": 3.0,
    }
    assert e["tokens"] == toks and e["train_rows"] == rows and e["lora_b"] * 1e9 == pytest.approx(lora)
    assert e["parts"] == pytest.approx(parts)
    assert e["dp"] == pytest.approx(sum(parts.values()))
    assert e["fsdp"] == pytest.approx(e["dp"] - (parts["transformer"] + parts["trainable"]) / 2)


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_config_header_states_the_current_estimate(path):
    rel = str(path.relative_to(ROOT))
    line = em.header(str(path))
    text = path.read_text()
    head = text[: text.index("\nname:")]
    assert line in head, f"{rel}: rerun `python scripts/estimate_memory.py {rel} --write`; expected:\n{line}"
