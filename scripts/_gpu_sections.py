"""The sections of scripts/gpu_check.py: each takes the check's context and returns a dict of measurements with
`ok` (what the section asserts). Real size: random weights at the published architectures (scripts/_gpu_archs.py);
--tiny: flowrl.models.tiny's pipelines and rewards/_tiny.py's checkpoints, the same code paths at test size."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import _gpu_archs as archs
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_FAMILY = {"sd3": "sd3", "flux": "flux", "wan": "wan", "wan22": "wan22_a14b"}


@dataclass
class Context:
    tiny: bool
    device: torch.device
    tmp: Path
    shared: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ---------------------------------------------------------------------------------------------------------- parts
def model_source(ctx: Context, family: str) -> str:
    """The folder `model.path` names: a tiny pipeline saved by flowrl.models.tiny, or the real-size stand-in."""
    from flowrl.models.tiny import build_tiny_pipeline

    if ctx.tiny or family == "wan22":
        return str(build_tiny_pipeline(TINY_FAMILY[family], ctx.tmp / "tiny" / TINY_FAMILY[family]))
    return str(archs.real_pipeline_folder(family, ctx.tmp / "real" / family))


def pickscore(ctx: Context) -> dict:
    """PickScore's kwargs: rewards/_tiny.py's tiny CLIP, or ViT-H-14 with random weights (real size)."""
    if "pickscore" not in ctx.shared:
        folder = ctx.tmp / "pickscore"
        if ctx.tiny:
            from rewards._tiny import tiny_pickscore

            ctx.shared["pickscore"] = tiny_pickscore(folder)
        else:
            archs.real_clip_folder(folder)
            ctx.shared["pickscore"] = {"model_name": str(folder), "processor_name": str(folder)}
    return ctx.shared["pickscore"]


def video_rewards(ctx: Context) -> list[dict]:
    """configs/wan/grpo_video.yaml's rewards: PickScore per frame every 4th frame, temporal consistency (open_clip
    ViT-B-32, random weights; tiny: rewards/_tiny.py's)."""
    from rewards._tiny import TINY_REWARDS, tiny_open_clip

    if ctx.tiny:
        temporal = TINY_REWARDS["temporal_consistency"](ctx.tmp / "temporal")
    else:  # the config alone: open_clip builds ViT-B-32 with random weights
        folder = tiny_open_clip(ctx.tmp / "temporal", with_weights=False, model_cfg=archs.OPEN_CLIP_VIT_B32)[0]
        temporal = {"model_name": folder, "pretrained": None}
    every = 2 if ctx.tiny else 4
    return [
        {"name": "per_frame", "weight": 1.0, "reward": "pickscore", "reward_config": pickscore(ctx), "reduce": "mean", "every_k_frames": every},
        {"name": "temporal_consistency", "weight": 0.5, **temporal},
    ]  # fmt: skip


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[last] = value


def run_config(ctx: Context, yaml_path: str, family: str, real: dict, tiny: dict, name: str):
    """The config file with the check's overrides: the model folder, this device, no trackers, no gold rewards, and
    the real-size batch of one GPU (`real`) or the tiny sizes (`tiny`)."""
    from flowrl.config import read_config_data
    from flowrl.trainers import build_config

    data = read_config_data(ROOT / yaml_path)
    overrides = {
        "name": name,
        "output_dir": str(ctx.tmp / "runs"),
        "device": str(ctx.device),
        "model.path": model_source(ctx, family),
        "logging": {"trackers": [], "progress_bar": False},
        "eval.gold_rewards": [],
        "data.prompts_file": str(ROOT / data["data"]["prompts_file"]),
        **(tiny if ctx.tiny else real),
    }
    if ctx.tiny and not ctx.cuda:  # half precision on a CPU: float32 (the ratio check holds at every precision)
        overrides.update({"model.dtype": "float32", "model.mixed_precision": "fp32"})
    for key, value in overrides.items():
        _set(data, key, value)
    return build_config(data)


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in trainer.parts.model.transformer.named_parameters() if p.requires_grad}


class FirstPass:
    """Records the ratios of every transition recomputed before the step's first optimizer step (the first pass,
    whose ratio must be exactly 1) by wrapping the clipped_policy_loss GRPO's ratio control calls (trainers/guard.py)."""

    def __init__(self, trainer):
        self.trainer, self.ratios, self.start = trainer, [], 0

    def __enter__(self):
        import flowrl.trainers.guard as guard

        self.module, self.original = guard, guard.clipped_policy_loss

        def recorded(log_probs, old_log_probs, advantages, clip_range):
            loss, stats = self.original(log_probs, old_log_probs, advantages, clip_range)
            if self.trainer.parts.opt.optimizer_steps == self.start:
                self.ratios.append(stats["ratio"].detach().double().cpu())
            return loss, stats

        guard.clipped_policy_loss = recorded
        return self

    def __exit__(self, *exc):
        self.module.clipped_policy_loss = self.original

    def step(self) -> dict:
        """One training step: its perf/* and train/ratio_* metrics, the first pass's ratios, peak memory."""
        self.ratios, self.start = [], self.trainer.parts.opt.optimizer_steps
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tic = time.perf_counter()
        metrics = self.trainer.train_step()
        out = {k: float(v) for k, v in metrics.items() if k.startswith(("perf/", "train/ratio", "train/loss", "train/optimizer"))}
        out["seconds"] = time.perf_counter() - tic
        ratios = torch.cat(self.ratios) if self.ratios else torch.ones(0)
        out["first_pass_transitions"] = int(ratios.numel())
        out["first_pass_ratio_min"] = float(ratios.min()) if ratios.numel() else None
        out["first_pass_ratio_max"] = float(ratios.max()) if ratios.numel() else None
        out["first_pass_ratio_exactly_1"] = bool(ratios.numel() and (ratios == 1).all())
        out["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
        return out


def grpo_run(cfg, num_steps: int, after_step=None) -> tuple[object, list[dict]]:
    from flowrl.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    steps = []
    with FirstPass(trainer) as first:
        for i in range(num_steps):
            steps.append(first.step())
            if after_step is not None:
                after_step(i + 1, trainer)
    return trainer, steps


def _components(model) -> dict:
    out = {}
    for name, module in model.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            params = list(module.parameters())
            out[name] = {
                "dtypes": sorted({str(p.dtype) for p in params}),
                "devices": sorted({str(p.device) for p in params}),
                "params_M": round(sum(p.numel() for p in params) / 1e6, 3),
            }
    return out


# ------------------------------------------------------------------------------------------------------- sections
SD3_YAML = "configs/sd3/grpo_pickscore.yaml"
# Flow-GRPO's 48 prompts x 24 on 32 GPUs: 36 samples a GPU, here 3 prompts x 12; 4 chunks / minibatches of 9
SD3_REAL = {"data.num_prompts_per_step": 3, "data.group_size": 12}
SD3_TINY = {
    "data.num_prompts_per_step": 2,
    "data.group_size": 2,
    "sampler.num_steps": 3,
    "sampler.height": 32,
    "sampler.width": 32,
    "train.num_minibatches": 2,
    "train.num_rollout_batches": 2,
    "train.gradient_accumulation_steps": 2,
}


def sd3_config(ctx: Context, name: str = "gpu_check_sd3"):
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    return run_config(ctx, SD3_YAML, "sd3", {**SD3_REAL, **reward}, {**SD3_TINY, **reward}, name)


def sd3_loader(ctx: Context) -> dict:
    """(1) SD3.5-M with its full-size text encoders through build_policy: dtypes, devices, fp32 LoRA, checkpointing."""
    from accelerate.utils import set_seed

    from flowrl.models import build_policy

    cfg = sd3_config(ctx)
    set_seed(cfg.seed)
    tic = time.perf_counter()
    model = build_policy(cfg.model, ctx.device)
    load_s = time.perf_counter() - tic
    lora = {n: p for n, p in model.transformer.named_parameters() if "lora_" in n}
    frozen = {str(p.dtype) for n, p in model.transformer.named_parameters() if "lora_" not in n}
    out = {
        "load_s": load_s,
        "components": _components(model),
        "lora_params": len(lora),
        "lora_params_M": sum(p.numel() for p in lora.values()) / 1e6,
        "lora_all_float32": all(p.dtype == torch.float32 and p.requires_grad for p in lora.values()),
        "frozen_transformer_dtypes": sorted(frozen),
        "gradient_checkpointing": bool(getattr(model.transformer, "is_gradient_checkpointing", False)),
        "memory_allocated_GB": torch.cuda.memory_allocated() / 1e9 if ctx.cuda else None,
        "real_size_on_meta": archs.count_params("sd3", ctx.tmp / "meta" / "sd3"),
    }
    on_device = all(ctx.device.type in d for c in out["components"].values() for d in c["devices"])
    out["all_on_device"] = on_device
    out["ok"] = bool(lora) and out["lora_all_float32"] and out["gradient_checkpointing"] and on_device
    return out


def sd3_grpo(ctx: Context) -> dict:
    """(2) Two GRPO steps of configs/sd3/grpo_pickscore.yaml at one GPU's batch: ratio 1, memory, perf/*."""
    cfg = sd3_config(ctx)

    def keep_checkpoint(step, trainer):
        from flowrl.training.loop import save_recipe

        if step == 1:
            ctx.shared["sd3_checkpoint"] = str(save_recipe(trainer))

    trainer, steps = grpo_run(cfg, 2, keep_checkpoint)
    ctx.shared["sd3_weights"] = trainable(trainer)
    ctx.shared["sd3_cfg"] = cfg
    with archs.building("meta", torch.float32):
        from transformers import CLIPConfig, CLIPModel

        reward_params = sum(p.numel() for p in CLIPModel(CLIPConfig(**archs.CLIP_VIT_H14)).parameters())
    return {
        "local_samples": trainer.parts.local_n,
        "steps": steps,
        "peak_memory_GB": max((s["peak_memory_GB"] or 0.0) for s in steps) if ctx.cuda else None,
        "pickscore_real_params_B_on_meta": reward_params / 1e9,
        "ok": all(s["first_pass_ratio_exactly_1"] for s in steps),
    }


def sd3_resume(ctx: Context) -> dict:
    """(3) A fresh trainer resumes from section 2's step-1 checkpoint; its step-2 weights equal the straight run's."""
    from flowrl.trainers.grpo import GRPOTrainer
    from flowrl.training.loop import resume_recipe

    if "sd3_checkpoint" not in ctx.shared or "sd3_weights" not in ctx.shared:
        raise RuntimeError("needs section sd3_grpo's step-1 checkpoint and step-2 weights, which it did not produce")
    trainer = GRPOTrainer(ctx.shared["sd3_cfg"])
    resume_recipe(trainer, ctx.shared["sd3_checkpoint"])
    with FirstPass(trainer) as first:
        step = first.step()
    resumed, straight = trainable(trainer), ctx.shared["sd3_weights"]
    differ = [n for n in straight if n not in resumed or not torch.equal(straight[n], resumed[n])]
    diff = max((float((straight[n] - resumed[n]).abs().max()) for n in differ if n in resumed), default=0.0)
    return {
        "checkpoint": ctx.shared["sd3_checkpoint"],
        "step_after_resume": trainer.parts.step,
        "tensors": len(straight),
        "tensors_differing": len(differ),
        "max_abs_difference": diff,
        "bitwise_equal": not differ and len(resumed) == len(straight),
        "step": step,
        "ok": not differ and len(resumed) == len(straight) and trainer.parts.step == 2,
    }


def prompt_cache(ctx: Context) -> dict:
    """(4) Bytes a cached prompt holds (embeddings with the CFG negative, on the model's device), and encode time."""
    from flowrl.models import load_flow_model

    cfg = sd3_config(ctx)
    m = cfg.model
    model = load_flow_model(m.path, m.dtype, ctx.device, m.max_sequence_length, m.mixed_precision)
    prompts = [p for p in Path(cfg.data.prompts_file).read_text().splitlines() if p.strip()][:8]
    tic = time.perf_counter()
    model.encode(prompts, guidance_scale=cfg.sampler.kwargs.get("guidance_scale", 4.5))
    if ctx.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - tic
    cache = model._cache
    entry = next(iter(cache._entries.values()))
    return {
        "prompts": len(cache),
        "bytes_per_prompt": cache.nbytes / len(cache),
        "MB_per_prompt": cache.nbytes / len(cache) / 1e6,
        "entry": {k: [list(v.shape), str(v.dtype)] for k, v in entry.items() if isinstance(v, torch.Tensor)},
        "encode_s_per_prompt": seconds / len(prompts),
        "max_sequence_length": model.max_sequence_length,
        "ok": len(cache) == len(set(prompts)) and cache.nbytes > 0,
    }


def _one_step(ctx: Context, yaml_path: str, family: str, real: dict, tiny: dict, meta: str | None) -> dict:
    cfg = run_config(ctx, yaml_path, family, real, tiny, f"gpu_check_{family}")
    trainer, steps = grpo_run(cfg, 1)
    out = {"local_samples": trainer.parts.local_n, "step": steps[0], "components": _components(trainer.parts.model)}
    if meta:
        out["real_size_on_meta"] = archs.count_params(meta, ctx.tmp / "meta" / meta)
    out["ok"] = steps[0]["first_pass_ratio_exactly_1"]
    return out


def flux_step(ctx: Context) -> dict:
    """(5) One FLUX.1-dev step at configs/flux/grpo_hpsv2.yaml's 720 px (PickScore stands in for HPSv2: same ViT-H-14)."""
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    real = {"data.num_prompts_per_step": 1, "data.group_size": 4, **reward}
    tiny = {**SD3_TINY, **reward}
    return _one_step(ctx, "configs/flux/grpo_hpsv2.yaml", "flux", real, tiny, "flux")


WAN_TINY = {
    **SD3_TINY,
    "sampler.height": 16,
    "sampler.width": 16,
    "sampler.num_frames": 5,
    "train.gradient_accumulation_steps": 1,
}


def wan_step(ctx: Context) -> dict:
    """(6) One Wan2.1-1.3B step at configs/wan/grpo_video.yaml's 480x832x33, 20 steps, with its video rewards; a
    quarter of the transitions train (time budget)."""
    rewards = {"rewards": video_rewards(ctx)}
    real = {"data.num_prompts_per_step": 1, "data.group_size": 2, "train.timestep_fraction": 0.25, **rewards}
    return _one_step(ctx, "configs/wan/grpo_video.yaml", "wan", real, {**WAN_TINY, **rewards}, "wan")


def wan22_step(ctx: Context) -> dict:
    """(7) The tiny Wan 2.2 A14B pipeline (two experts, the high-noise one trains) for one step on this device."""
    tiny = ctx if ctx.tiny else Context(True, ctx.device, ctx.tmp / "tiny_rewards")  # the tiny model, tiny rewards
    rewards = {"rewards": video_rewards(tiny)}
    sizes = {**WAN_TINY, "sampler.num_steps": 4, **rewards}
    out = _one_step(ctx, "configs/wan/grpo_video_wan22_a14b.yaml", "wan22", sizes, sizes, None)
    experts = {k: v for k, v in out["components"].items() if k.startswith("transformer")}
    out["experts_on_device"] = len(experts) == 2 and all(ctx.device.type in d for e in experts.values() for d in e["devices"])
    out["ok"] = out["ok"] and out["experts_on_device"]
    return out


def preview_speed(ctx: Context) -> dict:
    """(8) Forwards per second of the SD3.5-M transformer at bf16 and at each preview precision flowrl.quant builds
    (real FP8 through torchao on sm_89+; the fake-quant emulations; int8 on the CPU)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.quant import PreviewSpec, build_preview, torchao_installed

    if ctx.tiny:
        folder = model_source(ctx, "sd3")
        model = SD3Transformer2DModel.from_pretrained(f"{folder}/transformer").to(ctx.device)
        batch, side, text, repeats = 2, 16, 8, 2
    else:
        with archs.building(ctx.device, torch.bfloat16):
            model = archs.transformer("sd3")
        batch, side, text, repeats = 8, 128, 333, 10
    model = model.eval().requires_grad_(False)
    dtype, c = next(model.parameters()).dtype, model.config
    inputs = dict(
        hidden_states=torch.randn(batch, c.in_channels, side, side, device=ctx.device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text, c.joint_attention_dim, device=ctx.device, dtype=dtype),
        pooled_projections=torch.randn(batch, c.pooled_projection_dim, device=ctx.device, dtype=dtype),
        timestep=torch.full((batch,), 500.0, device=ctx.device),
        return_dict=False,
    )

    def per_second(module) -> float:
        with torch.no_grad():
            module(**inputs)
            sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
            sync()
            tic = time.perf_counter()
            for _ in range(repeats):
                module(**inputs)
            sync()
        return repeats / (time.perf_counter() - tic)

    base = per_second(model)
    out = {"batch": batch, "latent_side": side, "dtype": str(dtype), "torchao": torchao_installed()}
    if ctx.cuda:
        out["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(ctx.device))
    out["formats"] = {"bf16" if not ctx.tiny else str(dtype): {"forwards_per_s": base, "ratio": 1.0}}
    for backend in ("fp8", "fake_fp8", "nvfp4", "int8"):
        try:
            preview = build_preview(model, PreviewSpec([backend]), "sd3")
            speed = per_second(preview)
            out["formats"][backend] = {"forwards_per_s": speed, "ratio": speed / base}
            del preview
        except Exception as err:  # noqa: BLE001 - each format records why it did not run here
            out["formats"][backend] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    ran = [k for k, v in out["formats"].items() if "forwards_per_s" in v]
    out["ran"] = ran
    out["ok"] = len(ran) >= 2 and (not ctx.cuda or ctx.tiny or "fp8" in ran or "fake_fp8" in ran)
    return out


SECTIONS = {
    "sd3_loader": (sd3_loader, 90),
    "sd3_grpo": (sd3_grpo, 180),
    "sd3_resume": (sd3_resume, 120),
    "prompt_cache": (prompt_cache, 45),
    "flux_step": (flux_step, 120),
    "wan_step": (wan_step, 150),
    "wan22_step": (wan22_step, 45),
    "preview_speed": (preview_speed, 60),
}
"""name -> (function, time budget in seconds on one H200; --tiny multiplies none: its sizes are seconds)"""
