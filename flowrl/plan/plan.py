"""`flowrl plan CONFIG`: before a launch, what one training step of a config does, how long it takes, and whether
it fits.

    flowrl plan configs/sd3/grpo_pickscore.yaml --gpu h100 --num-gpus 8 [--json plan.json]

1. **The work comes from the code.** The config's own recipe runs one step on a stand-in: the model family's tiny
   pipeline (real diffusers classes, random weights: the same adapter, CFG rule, packing and expert switch as the real
   model), at a small resolution, with stand-in rewards (flowrl.training.scoring.StandInReward), the whole global
   batch on one CPU process. The work meter (flowrl.work) counts what the step runs: transformer rows forward and
   backward, previews, decodes, text encodes, reward calls. None of those counts depend on the resolution or the
   width of the network, so they are the real run's counts.
2. **The price comes from the real architecture** (flowrl.plan.cost): the family's published transformer built on
   the meta device, its FLOPs counted at the config's resolution and text length, the hardware table and an
   efficiency η (research code 0.11, tuned 0.4; docs/cost.md). Data parallel: each GPU does 1/N of the step.
3. **The memory comes from the real architecture too** (flowrl.plan.memory): parameters counted on meta, the LoRA
   adapter's parameters by adding it there, activations of one row counted with saved-tensor hooks on meta, times the
   rows of one micro-batch (the minibatch one backward runs on, classifier-free guidance doubling it), plus text
   encoders, VAE and reward models resident, divided as FSDP2 / ZeRO-2 shard them.

A toy config (`model.path: toy`) is priced as SD3.5-Medium at 512 px (the race's convention, flowrl.bench.trainers):
the toy recipe's structure at a real model's price.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

GPUS = ("h100", "h200", "b200")
TOY_PRICED_AS = ("sd3.5-medium", 512, 512, None)  # the race's convention for toy configs
CHECKPOINTING_DEFAULT = True  # what a plan assumes for suggestions when the config has no checkpointing

# the tiny pipeline (flowrl.models.tiny) of each family: the stand-in that runs the config's step
TINY = {
    "sd3.5-medium": "sd3",
    "sd3.5-large": "sd3",
    "flux.1-dev": "flux",
    "flux.2-klein-9b": "flux2_klein",
    "flux.2-klein-4b": "flux2_klein",
    "flux.2-dev": "flux2_dev",
    "sana-1.6b": "sana",
    "wan2.1-1.3b": "wan",
    "wan2.1-14b": "wan",
    "wan2.2-ti2v-5b": "wan22_ti2v",
    "wan2.2-a14b": "wan22_a14b",
    "qwen-image": "qwen_image",
    "qwen-image-edit": "qwen_image_edit",
    "z-image": "z_image",
    "ltx-2": "ltx2",
}


def tiny_family(family: str, model_path: str) -> str:
    """The tiny pipeline standing in for `family` (image-to-video checkpoints have their own)."""
    if family == "wan2.2-a14b" and "i2v" in model_path.lower():
        return "wan_i2v"
    if family == "qwen-image-edit" and "2509" in model_path:
        return "qwen_image_edit_plus"
    return TINY[family]


# keys a stand-in run overrides: no checkpoint, no evaluation, no trackers, the CPU in float32, the default switches
STAND_IN = [
    "device=cpu",
    "model.dtype=float32",
    "model.mixed_precision=fp32",
    "model.compile=false",
    "model.attention_backend=sdpa",
    "model.offload_text_encoders=false",
    "model.init_lora=null",
    "logging.trackers=[]",
    "logging.progress_bar=false",
    "eval.every_n_steps=0",
    "checkpoint.every_n_steps=0",
    "checkpoint.resume=null",
]


def step_work(config: str | Path, overrides: list[str] = ()) -> tuple[dict[str, float], object]:
    """The work meter's counts of one training step of `config` (flowrl.work: `work/<phase>/<kind>/<detail>`), run
    on its stand-in (see the module docstring), and the config as the user wrote it.

    Prompt groups are independent, so the stand-in runs the fewest of the step's groups that the config accepts (a
    divisor k of data.num_prompts_per_step: its chunks and minibatches must divide) and the counts are scaled by
    num_prompts_per_step / k; its text encoders run at 8 tokens (the price uses the real length)."""
    from flowrl.models.tiny import TINY_SIZES, build_tiny_pipeline
    from flowrl.plan import archs
    from flowrl.trainers import build_trainer, load_config, trainer_class
    from flowrl.training.loop import metered_step
    from flowrl.training.scoring import standing_in

    cfg = load_config(config, list(overrides))
    prompts = cfg.data.num_prompts_per_step
    with tempfile.TemporaryDirectory(prefix="flowrl-plan-") as tmp:
        # a recipe's own settings that leave the per-step price alone, made small (SMOPD: its teachers' steps)
        stand_in = [
            *STAND_IN,
            *getattr(trainer_class(cfg.trainer), "plan_overrides", ()),
            f"output_dir={tmp}",
            "name=plan",
        ]
        if cfg.model.path != "toy":
            family = archs.family_of(cfg.model.path).key
            tiny = tiny_family(family, cfg.model.path)
            folder = build_tiny_pipeline(tiny, Path(tmp) / tiny)
            height, width, frames = TINY_SIZES[tiny]
            stand_in.append(f"model.path={folder}")
            if frames:
                stand_in.append(f"sampler.num_frames={frames}")
            if any(word in tiny for word in ("edit", "i2v")):  # a source image keeps the config's aspect
                height, width = _smallest_same_aspect(
                    cfg.sampler.kwargs.get("height"), cfg.sampler.kwargs.get("width"), height
                )
            stand_in += [f"sampler.height={height}", f"sampler.width={width}"]
            if _prompt_length_settable(folder) and "edit" not in tiny:  # an edit prompt carries its image
                stand_in.append("model.max_sequence_length=8")
        cache = cfg.sampler.kwargs.get("preview_cache") or {}
        if cfg.model.path != "toy" and cache.get("type") == "first_block":
            # the tiny stand-ins have one or two blocks, too few for a first-block cache; a cached preview is priced
            # as a full forward whatever its cache type (docs/cost.md), so another type counts the same rows
            stand_in.append("sampler.preview_cache={type: taylorseer}")
        errors = []
        for k in [d for d in range(1, prompts + 1) if prompts % d == 0]:
            try:
                run = load_config(config, [*overrides, *stand_in, f"data.num_prompts_per_step={k}"])
                with standing_in():
                    trainer = build_trainer(run)
            except ValueError as err:  # this k splits into chunks or minibatches the config refuses
                errors.append(f"{k}: {err}")
                continue
            with standing_in():
                metrics = metered_step(trainer)
            for key, value in getattr(
                trainer, "offline_work", {}
            ).items():  # an offline pool's work, billed once (gdro)
                metrics[key] -= value
            if trainer.parts.scorer is not None:
                trainer.parts.scorer.close()
            scale = prompts / k
            return {k_: v * scale for k_, v in metrics.items() if k_.startswith("work/")}, cfg
    raise ValueError(f"{config}: no share of its {prompts} prompts per step runs on the stand-in: {errors[-1]}")


def _smallest_same_aspect(height: int | None, width: int | None, unit: int) -> tuple[int, int]:
    """The smallest multiples of `unit` with exactly the aspect of height x width (the tiny size when unset)."""
    import math

    if not height or not width:
        return unit, unit
    g = math.gcd(int(height), int(width))
    h, w = int(height) // g, int(width) // g  # the aspect in lowest terms
    for m in range(1, g + 1):
        if (h * m) % unit == 0 and (w * m) % unit == 0:
            return h * m, w * m
    return int(height), int(width)


def _prompt_length_settable(folder: Path) -> bool:
    """Whether the adapter of a pipeline folder lets the prompt length be set (`set_max_sequence_length`)."""
    import importlib

    from flowrl.models import ADAPTERS

    module, cls = ADAPTERS[json.loads((Path(folder) / "model_index.json").read_text())["_class_name"]]
    return hasattr(getattr(importlib.import_module(module), cls), "set_max_sequence_length")


@dataclass(frozen=True)
class Geometry:
    """What the price depends on: the family, the sample size and the text length."""

    family: str
    height: int
    width: int
    num_frames: int | None
    text_tokens: int
    priced_as_toy: bool = False


def geometry(cfg) -> Geometry:
    """The real family and sample size of a config (a toy config: SD3.5-Medium at 512 px)."""
    from flowrl.plan import archs

    if cfg.model.path == "toy":
        family, height, width, frames = TOY_PRICED_AS
        return Geometry(family, height, width, frames, archs.get(family).text_tokens, priced_as_toy=True)
    arch = archs.family_of(cfg.model.path)
    kw = cfg.sampler.kwargs
    height, width, frames = (kw.get("height") or arch.default_size[0]), (kw.get("width") or arch.default_size[1]), None
    if arch.video:
        frames = kw.get("num_frames") or arch.default_size[2]
    text = arch.text_tokens
    if cfg.model.max_sequence_length:  # the T5 / LLM part; SD3's 77 CLIP tokens stay
        text = arch.fixed_text_tokens + int(cfg.model.max_sequence_length)
    return Geometry(arch.key, int(height), int(width), frames, int(text))


def _rewards(cfg) -> tuple[str, ...]:
    return tuple(r.name for r in cfg.rewards)


def micro_batch_rows(cfg, num_gpus: int, true_cfg: bool) -> int:
    """Rows of one backward on one GPU: the process's share of the step's samples (x the recipe's items per sample)
    over the minibatches, doubled where the recipe trains with classifier-free guidance (its `cfg_doubles_train_rows`:
    both branches carry grad) and the model runs true CFG at a guidance scale above 1."""
    from flowrl.trainers import trainer_class

    t = cfg.train
    local = max(1, cfg.data.num_prompts_per_step * cfg.data.group_size // num_gpus)
    items = local * getattr(t, "num_loss_targets_per_sample", 1)
    rows = max(1, items // max(1, t.num_minibatches))
    guidance = cfg.sampler.kwargs.get("guidance_scale")
    if trainer_class(cfg.trainer).cfg_doubles_train_rows and true_cfg and guidance is not None and guidance > 1.0:
        rows *= 2
    return rows


def memory_plan(cfg, geo: Geometry, num_gpus: int, sharding: str):
    """The MemoryPlan of the config's run on `num_gpus` GPUs (flowrl.plan.memory): the real transformer on meta,
    in the dtype its activations take (16 bits under bf16/fp16 autocast), activations counted per row and the working
    memory of a backward at the plan's rows."""
    import torch

    from flowrl.models import parse_dtype
    from flowrl.models.lora import LoRAMixin
    from flowrl.plan import activations, archs, memory
    from flowrl.trainers import trainer_class

    recipe = trainer_class(cfg.trainer)  # what the recipe keeps beside the policy: its declarations
    arch = archs.get(geo.family)
    module = archs.build_transformer(arch)
    params = activations.param_count(module)
    largest = max((activations.param_count(b) for name, b in module.named_modules() if _is_block(name)), default=0)
    targets = tuple(cfg.model.lora_target_modules or LoRAMixin.lora_target_modules)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        cfg.model.mixed_precision, parse_dtype(cfg.model.dtype)
    )
    rows = micro_batch_rows(cfg, num_gpus, arch.true_cfg)

    def inputs(n: int):
        one = archs.transformer_inputs(arch, geo.height, geo.width, geo.num_frames, geo.text_tokens)
        out = {}
        for k, v in one.items():
            if _batched(v):
                out[k] = v.to(compute).expand(n, *v.shape[1:])
            elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v):
                out[k] = [t.to(compute) for t in v] * n  # one tensor per sample (Z-Image)
            else:
                out[k] = v
        return out

    per_row, transient, lora_params = {}, {}, 0
    own = (cfg.model.use_lora, cfg.model.use_gradient_checkpointing)
    for lora in (own[0], not own[0]):
        net = archs.build_transformer(arch) if lora else module  # LoRA is added in place: a second build of its own
        if lora:
            net = activations.with_lora(net, cfg.model.lora_rank, targets, cfg.model.lora_alpha)
            lora_params = activations.param_count(net, trainable=True)
        else:
            net.requires_grad_(True)
        net = net.to(compute)
        for ckpt in (own[1], not own[1]):
            # the working memory of a backward is counted for the config's own mode (the slow part); the other
            # modes, which only the suggestions use, take it from there
            count = activations.count_activations(
                net, inputs, rows=rows, checkpointing=ckpt, working=(lora, ckpt) == own
            )
            per_row[(lora, ckpt)] = count.total / rows
            transient[(lora, ckpt)] = count.transient if (lora, ckpt) == own else None
    transient = {mode: transient[own] if t is None else t for mode, t in transient.items()}
    t = cfg.train
    return memory.MemoryPlan(
        params=params,
        activation_row_bytes=per_row,
        transient_bytes=transient,
        rows=rows,
        use_lora=cfg.model.use_lora,
        lora_params=lora_params,
        checkpointing=cfg.model.use_gradient_checkpointing,
        weight_dtype=cfg.model.dtype,
        mixed_precision=cfg.model.mixed_precision,
        reference_copy=not cfg.model.use_lora and recipe.full_reference_copy,
        adapter_copies=recipe.adapter_copies if cfg.model.use_lora else 0,  # an old / EMA adapter beside the policy
        use_ema=bool(t.use_ema),
        frozen=_frozen(cfg, arch),
        sharding=sharding,
        num_gpus=num_gpus,
        largest_block_params=largest,
    )


def _batched(v) -> bool:
    import torch

    return isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == 1 and v.is_floating_point()


def _is_block(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 2 and parts[1].isdigit() and "block" in parts[0]


def _frozen(cfg, arch) -> tuple:
    """Text encoders, VAE, a second expert and reward models resident beside the trained transformer."""
    from flowrl.plan import activations, archs, cost, memory

    out = []
    for enc in arch.text_encoders:
        out.append(
            memory.Frozen(enc.name, int(enc.params_b * 1e9), cfg.model.dtype, cfg.model.offload_text_encoders, True)
        )
    vae = archs.build_vae(arch)
    out.append(memory.Frozen("vae", activations.param_count(vae), cfg.model.dtype))
    if arch.experts > 1:
        out.append(
            memory.Frozen("second expert", activations.param_count(archs.build_transformer(arch)), cfg.model.dtype)
        )
    for name in _rewards(cfg):
        params = cost.reward_params(name)
        if params:
            out.append(memory.Frozen(f"reward {name}", int(params), "float32"))
    return tuple(out)


def plan(
    config: str | Path,
    gpu: str | None = None,
    num_gpus: int = 1,
    sharding: str = "none",
    overrides: list[str] = (),
    json_out: str | Path | None = None,
) -> dict:
    """The plan of `config` on `num_gpus` GPUs (each of GPUS, or only `gpu`); written to `json_out` when given."""
    from flowrl.plan import cost, memory

    _quiet()
    if gpu is not None and gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {', '.join(GPUS)}")
    if num_gpus < 1:
        raise ValueError(f"--num-gpus {num_gpus} must be >= 1")
    work, cfg = step_work(config, overrides)
    geo = geometry(cfg)
    size = cost.real_size(geo.family, geo.height, geo.width, geo.num_frames, geo.text_tokens, _rewards(cfg))
    forward = size.forward
    gpus = [gpu] if gpu else list(GPUS)
    step_s, run_h, by_phase = {}, {}, {}
    for g in gpus:
        priced = {name: cost.price(work, size, g, eta) for name, eta in cost.ETA.items()}
        step_s[g] = {name: p["seconds"] / num_gpus for name, p in priced.items()}
        run_h[g] = {name: p["seconds"] * cfg.num_steps / 3600 for name, p in priced.items()}
        by_phase[g] = {name: {ph: s / num_gpus for ph, s in p["by_phase"].items()} for name, p in priced.items()}
    mem_plan = memory_plan(cfg, geo, num_gpus, sharding)
    peak = memory.estimate_peak(mem_plan)
    fits = {g: memory.fits(peak["total"], cost.HARDWARE[g].memory_gib) for g in gpus}
    advice = {g: memory.suggestion(mem_plan, cost.HARDWARE[g].memory_gib) for g in gpus if not fits[g]}
    result = {
        "config": str(config),
        "trainer": cfg.trainer,
        "family": geo.family,
        "priced_as_toy": geo.priced_as_toy,
        "size": {
            "height": geo.height,
            "width": geo.width,
            "num_frames": geo.num_frames,
            "text_tokens": geo.text_tokens,
        },
        "num_gpus": num_gpus,
        "sharding": sharding,
        "num_steps": cfg.num_steps,
        "params_b": round(forward.params_b, 3),
        "transformer_forward_tflops": round(forward.tflops, 3),
        "step": {"work": work, "gpu_seconds_by_phase": by_phase},
        "step_gpu_seconds": step_s,
        "run_gpu_hours": run_h,
        "eta": dict(cost.ETA),
        "peak_memory_gib": {k: round(v, 2) for k, v in peak.items() if k != "trainable_params"},
        "trainable_params": int(peak["trainable_params"]),
        "micro_batch_rows": mem_plan.rows,
        "fits": fits,
        "suggestion": advice,
    }
    if json_out is not None:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _quiet() -> None:
    """The stand-in's libraries say nothing a plan's reader needs (casts on meta, truncated stand-in prompts)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


PHASE_LABEL = {"rollout": "rollout", "score": "rewards", "train": "training"}


def render(result: dict) -> str:
    """The plan as the terminal shows it (and a config's header quotes it)."""
    work = result["step"]["work"]

    def count(prefix: str) -> float:
        return sum(v for k, v in work.items() if k.startswith(prefix))

    size = result["size"]
    what = f"{size['height']}x{size['width']}" + (f"x{size['num_frames']}" if size["num_frames"] else "")
    lines = [
        f"{result['config']}: trainer {result['trainer']}, {result['family']} at {what}, "
        f"{size['text_tokens']} text tokens"
        + (" (a toy config, priced as SD3.5-Medium at 512 px)" if result["priced_as_toy"] else ""),
        f"  transformer: {result['params_b']:.2f} B parameters, "
        f"{result['transformer_forward_tflops']:.2f} TFLOP per forward",
        "  one step: "
        + ", ".join(
            [
                f"{count('work/rollout/forward/'):.0f} rollout forwards",
                f"{count('work/train/forward/'):.0f} training forwards",
                f"{count('work/train/backward/'):.0f} backwards",
                f"{count('work/rollout/decode/images') + count('work/train/decode/images'):.0f} decodes",
                f"{count('work/score/reward/'):.0f} reward calls",
            ]
        ),
    ]
    for g, per in result["step_gpu_seconds"].items():
        phases = result["step"]["gpu_seconds_by_phase"][g]["research"]
        split = ", ".join(f"{PHASE_LABEL.get(p, p)} {s:.1f}" for p, s in phases.items())
        lines.append(
            f"  {g} x{result['num_gpus']}: {per['research']:.1f} s/step at eta {result['eta']['research']} ({split}), "
            f"{per['tuned']:.1f} s at eta {result['eta']['tuned']}; run of {result['num_steps']} steps: "
            f"{result['run_gpu_hours'][g]['research']:.0f} GPU-hours ({result['run_gpu_hours'][g]['tuned']:.0f} tuned)"
        )
    peak = result["peak_memory_gib"]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in peak.items() if k != "total" and v >= 0.05)
    lines.append(f"  peak memory per GPU: {peak['total']:.1f} GiB ({parts}; {result['sharding']} sharding)")
    for g, ok in result["fits"].items():
        if not ok:
            lines.append(f"  WARNING {g}: {result['suggestion'][g]}")
    return "\n".join(lines)
