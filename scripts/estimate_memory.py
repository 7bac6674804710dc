"""Peak memory per GPU of a config, estimated from parameter counts and token counts (docs/gpu.md#memory-estimates).

    python scripts/estimate_memory.py configs/sd3/grpo_pickscore.yaml [--num-gpus 8] [--gpu-gib 80] [--write]

Parameters of SD3.5-M, FLUX.1-dev and Wan2.1-1.3B (and their text encoders and VAEs) are counted on the meta device
from scripts/_gpu_archs.py; the other families use the published counts in FAMILIES (sources noted). An estimate
until `flowrl plan` and a GPU measurement replace it.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 1024**3
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACT_LAYER = 34  # bytes per token per hidden unit of one layer's activations (16-bit, flash attention: Korthikanti 2022)
ACT_KEPT = 2  # bytes per token per hidden unit per layer kept under full checkpointing (the layer's 16-bit input)
OVERHEAD_GIB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation, rollout latents (an assumption)


@dataclass(frozen=True)
class Family:
    """A model family: the transformer's params (B) and its hidden width / layers, or the _gpu_archs family that
    counts them on meta (`arch`), plus the rest of the pipeline and the token geometry."""

    key: str  # a substring of model.path
    hidden: int
    layers: int
    px_per_token: int  # VAE factor x patch size
    text_tokens: int  # default text length (model.max_sequence_length overrides the T5/LLM part)
    extra_text: int = 0  # fixed text tokens besides it (SD3's 77 CLIP)
    arch: str | None = None  # counted on meta from scripts/_gpu_archs.py
    transformer_b: float = 0.0  # published count when not counted
    encoders_b: float = 0.0
    vae_b: float = 0.0
    joint: bool = False  # LoRA on 8 attention projections per layer (joint attention), else 4
    true_cfg: bool = True  # False: a distilled guidance embedding (one forward per step)
    frames_per_token: int = 0  # video: VAE temporal factor (tokens = ((frames-1)/f + 1) x spatial)
    image_tokens_x: int = 1  # Qwen-Image-Edit: the source image's tokens ride along
    experts: int = 1  # Wan2.2 A14B: two 14B experts, both resident
    source: str = "counted on meta (scripts/_gpu_archs.py)"


FAMILIES = [
    Family("stable-diffusion-3.5-medium", 1536, 24, 16, 256, 77, arch="sd3", joint=True),
    Family("stable-diffusion-3.5-large", 2432, 38, 16, 256, 77, transformer_b=8.1, encoders_b=5.58, vae_b=0.084,
           joint=True, source="8.1 B: stabilityai/stable-diffusion-3.5-large model card; encoders as SD3.5-M"),
    Family("FLUX.1-dev", 3072, 57, 16, 512, arch="flux", joint=True, true_cfg=False),
    Family("FLUX.2-dev", 6144, 56, 16, 512, transformer_b=32.0, encoders_b=24.0, vae_b=0.084, joint=True,
           true_cfg=False, source="32 B + Mistral-Small-3.1 24 B: BFL FLUX.2 announcement / model card"),
    Family("FLUX.2-klein-base-9B", 4096, 32, 16, 512, transformer_b=9.0, encoders_b=8.0, vae_b=0.084, joint=True,
           source="9 B + Qwen3-8B: BFL FLUX.2 [klein] model card; width/depth assumed"),
    Family("Sana_1600M", 2240, 20, 32, 300, transformer_b=1.6, encoders_b=2.6, vae_b=0.32,
           source="1.6 B, Gemma-2-2B, DC-AE f32: SANA paper arXiv 2410.10629"),
    Family("Qwen-Image-Edit", 3072, 60, 16, 1024, transformer_b=20.0, encoders_b=8.3, vae_b=0.13, joint=True,
           image_tokens_x=2, source="20 B MMDiT + Qwen2.5-VL-7B: Qwen-Image report arXiv 2508.02324"),
    Family("Qwen-Image", 3072, 60, 16, 512, transformer_b=20.0, encoders_b=8.3, vae_b=0.13, joint=True,
           source="20 B MMDiT + Qwen2.5-VL-7B: Qwen-Image report arXiv 2508.02324"),
    Family("Z-Image", 3840, 30, 16, 512, transformer_b=6.0, encoders_b=4.0, vae_b=0.084,
           source="6 B S3-DiT + Qwen3-4B: Z-Image model card / report arXiv 2511.22699"),
    Family("LTX-2", 4096, 48, 32, 1024, transformer_b=19.0, encoders_b=12.0, vae_b=0.5, frames_per_token=8,
           source="19 B (14 B video + 5 B audio) + Gemma-3-12B: Lightricks LTX-2 model card; VAE size assumed"),
    Family("Wan2.1-T2V-1.3B", 1536, 30, 16, 512, arch="wan", frames_per_token=4),
    Family("Wan2.2-TI2V-5B", 3072, 30, 32, 512, transformer_b=5.0, encoders_b=5.68, vae_b=0.7, frames_per_token=4,
           source="5 B, UMT5-XXL, Wan2.2-VAE f16: Wan2.2 README"),
    Family("A14B", 5120, 40, 16, 512, transformer_b=14.0, encoders_b=5.68, vae_b=0.127, frames_per_token=4,
           experts=2, source="2 x 14 B experts, UMT5-XXL: Wan2.2 README"),
]  # fmt: skip
# reward models' parameters (B), resident in the run's dtype
REWARDS_B = {
    "pickscore": 0.99, "hpsv2": 0.99,  # CLIP ViT-H-14 (counted on meta)
    "clipscore": 0.43, "aesthetic": 0.43, "image_consistency": 0.43,  # CLIP ViT-L/14 (OpenAI card: 428 M)
    "imagereward": 0.45,  # BLIP ViT-L + BERT-base (ImageReward, arXiv 2304.05977)
    "temporal_consistency": 0.15,  # open_clip ViT-B-32
    "ocr": 0.0,  # RapidOCR (ONNX on the CPU)
}  # fmt: skip


@functools.cache
def counted(arch: str) -> dict[str, float]:
    """Parameters (B) per pipeline component of a _gpu_archs family, built on the meta device."""
    import _gpu_archs

    with tempfile.TemporaryDirectory() as tmp:
        b = _gpu_archs.count_params(arch, Path(tmp))["params_B"]
    return {"transformer": b["transformer"], "vae": b["vae"], "encoders": sum(v for k, v in b.items() if "text" in k)}


def family_of(path: str) -> Family:
    for fam in FAMILIES:
        if fam.key.lower() in path.lower():
            return fam
    raise SystemExit(f"no memory model for model.path={path}; add it to FAMILIES")


def params_b(fam: Family) -> dict[str, float]:
    if fam.arch:
        return counted(fam.arch)
    return {"transformer": fam.transformer_b * fam.experts, "vae": fam.vae_b, "encoders": fam.encoders_b}


def tokens(fam: Family, height: int, width: int, frames: int | None, text_len: int | None) -> int:
    spatial = (height // fam.px_per_token) * (width // fam.px_per_token)
    latent_frames = (frames - 1) // fam.frames_per_token + 1 if fam.frames_per_token and frames else 1
    return spatial * latent_frames * fam.image_tokens_x + (text_len or fam.text_tokens) + fam.extra_text


def activations_gib(toks: int, batch: int, hidden: int, layers: int, dtype_bytes: int, checkpointing: bool) -> float:
    """One training forward's saved activations: with full checkpointing every layer keeps its input
    (ACT_KEPT·s·b·h) and one layer at a time is recomputed (ACT_LAYER·s·b·h); without it every layer keeps
    ACT_LAYER·s·b·h. The constants are for 16-bit; scaled by dtype_bytes / 2."""
    sbh = toks * batch * hidden * dtype_bytes / 2
    per = (ACT_KEPT * layers + ACT_LAYER) if checkpointing else ACT_LAYER * layers
    return per * sbh / GIB


def estimate(cfg, num_gpus: int) -> dict:
    m, d, t = cfg.model, cfg.data, cfg.train
    s = argparse.Namespace(**{"num_frames": None, "guidance_scale": 1.0, **cfg.sampler.kwargs})
    fam = family_of(m.path)
    p = params_b(fam)
    wb = BYTES[m.dtype]
    hidden, layers = fam.hidden, fam.layers
    targets = 8 if fam.joint else 4
    lora_b = m.lora_rank * targets * 2 * hidden * layers / 1e9 if m.use_lora else 0.0  # one expert trains (Wan2.2)
    trained_b = lora_b if m.use_lora else p["transformer"]
    local_n = d.num_prompts_per_step * d.group_size // num_gpus
    cfg_x = 2 if (cfg.trainer == "grpo" and fam.true_cfg and (s.guidance_scale or 0) > 1) else 1
    train_rows = max(1, local_n // t.num_minibatches) * cfg_x
    rollout_rows = max(1, local_n // getattr(t, "num_rollout_batches", 1)) * (2 if fam.true_cfg and (s.guidance_scale or 0) > 1 else 1)  # fmt: skip
    toks = tokens(fam, s.height, s.width, s.num_frames, m.max_sequence_length)
    act_train = activations_gib(toks, train_rows, hidden, layers, wb, m.use_gradient_checkpointing)
    act_rollout = ACT_LAYER * toks * rollout_rows * hidden * wb / 2 / GIB  # no grad: one layer live at a time
    rewards = sum(REWARDS_B.get(r.kwargs.get("reward", r.name), 0.5) for r in cfg.rewards)
    parts = {
        "transformer": p["transformer"] * 1e9 * wb / GIB,
        "trainable": trained_b * 1e9 * (4 + 4 + 8) / GIB,  # fp32 param (master) + fp32 grad + AdamW m, v
        "encoders": 0.0 if m.offload_text_encoders else p["encoders"] * 1e9 * wb / GIB,
        "vae": p["vae"] * 1e9 * wb / GIB,
        "rewards": rewards * 1e9 * wb / GIB,
        "activations": max(act_train, act_rollout),
        "overhead": OVERHEAD_GIB,
    }
    dp = sum(parts.values())
    fsdp = dp - (parts["transformer"] + parts["trainable"]) * (1 - 1 / num_gpus)
    return dict(family=fam, params=p, lora_b=lora_b, tokens=toks, local_n=local_n, train_rows=train_rows,
                parts=parts, dp=dp, fsdp=fsdp)  # fmt: skip


def header(cfg_path: str, num_gpus: int = 8, gpu_gib: int = 80, gpu: str = "H100") -> str:
    """The header line of a config: its GPUs, the sharding its accelerate preset names, the estimate."""
    from flowrl.trainers import load_config

    text = Path(cfg_path).read_text()
    sharded = "configs/accelerate/fsdp.yaml" in text
    e = estimate(load_config(cfg_path), num_gpus)
    peak = e["fsdp"] if sharded else e["dp"]
    line = (
        f"# Planned for: {num_gpus}x {gpu} {gpu_gib}GB ({'FSDP2' if sharded else 'DDP'}); estimated peak memory per "
        f"GPU: {math.ceil(peak)} GiB (scripts/estimate_memory.py; method: docs/gpu.md#memory-estimates)"
    )
    if peak > gpu_gib:
        fix = "fewer samples per training forward (train.num_minibatches up), model.offload_text_encoders: true"
        fix = fix if sharded else f"FSDP2 (configs/accelerate/fsdp.yaml: {math.ceil(e['fsdp'])} GiB), " + fix
        line += f"\n# Does not fit {gpu_gib} GiB by this estimate: try {fix}."
    return line


def with_header(text: str, line: str) -> str:
    """`text` with its estimate lines replaced by `line`, or `line` added after the leading comment block."""
    lines = [x for x in text.splitlines() if not x.startswith(("# Planned for: ", "# Does not fit "))]
    at = next(i for i, x in enumerate(lines) if not x.startswith("#"))
    return "\n".join([*lines[:at], line, *lines[at:]]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--num-gpus", type=int, default=8)
    ap.add_argument("--gpu-gib", type=int, default=80)
    ap.add_argument("--write", action="store_true", help="put the header line into each config")
    a = ap.parse_args(argv)
    from flowrl.trainers import load_config

    cols = ["transformer", "trainable", "encoders", "vae", "rewards", "activations", "overhead"]
    print(f"{'config':44s} {'tokens':>6s} {'rows':>4s} " + " ".join(f"{c[:8]:>8s}" for c in cols) + "   DP GiB  FSDP GiB")
    lines = []
    for path in a.configs:
        e = estimate(load_config(path), a.num_gpus)
        vals = " ".join(f"{e['parts'][c]:8.1f}" for c in cols)
        print(f"{path:44s} {e['tokens']:6d} {e['train_rows']:4d} {vals} {e['dp']:8.1f} {e['fsdp']:9.1f}")
        lines.append(header(path, a.num_gpus, a.gpu_gib))
        if a.write:
            Path(path).write_text(with_header(Path(path).read_text(), lines[-1]))
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
