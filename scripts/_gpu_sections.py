"""The sections of scripts/gpu_check.py: each takes the check's context and returns a dict of measurements with
`ok` (what the section asserts). Real size: random weights at the published architectures (scripts/_gpu_archs.py);
--tiny: flowrl.models.tiny's pipelines and rewards/_tiny.py's checkpoints, the same code paths at test size. The
instruments (measured steps, η and peaks per phase, the plan's estimate) are scripts/_gpu_measure.py's."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _gpu_archs as archs
import torch
from _gpu_measure import (  # noqa: F401 - compare_with_plan, plan_estimate: gpu_check.py's, through this module
    FSDP_CHILD,
    FSDP_ENV,
    GIB,
    ROOT,
    Context,
    FirstPass,
    _components,
    compare_with_plan,
    deterministic,
    eta_per_phase,
    measured_step,
    model_source,
    one_process_fsdp,
    pickscore,
    plan_estimate,
    plan_overrides,
    run_config,
    trainable,
    video_rewards,
)

# ------------------------------------------------------------------------------------------------------- sections
SD3_YAML = "configs/sd3/grpo_pickscore.yaml"
# Flow-GRPO's 48 prompts x 24 on 32 GPUs: 36 samples a GPU in 4 minibatches of 9; here one such minibatch (9 samples,
# 18 rows with CFG: the backward the full run's memory peaks at) as the whole step
SD3_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 9, "train.num_minibatches": 1,
            "train.num_rollout_batches": 1, "train.gradient_accumulation_steps": 1}  # fmt: skip
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


def sd3_sizes(ctx: Context) -> dict:
    return SD3_TINY if ctx.tiny else SD3_REAL


def sd3_config(ctx: Context, name: str = "gpu_check_sd3", yaml_path: str = SD3_YAML, extra: dict | None = None):
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    sizes = {**SD3_REAL, **(extra or {}), **reward}, {**SD3_TINY, **(extra or {}), **reward}
    return run_config(ctx, yaml_path, "sd3", *sizes, name)


def preview_speed(ctx: Context) -> dict:
    """Forwards per second of the SD3.5-M transformer at bf16 and at each preview precision flowrl.quant builds
    (real FP8 through torchao on sm_89+; the fake-quant emulations; int8 on the CPU), and the bf16 forward's η."""
    from diffusers import SD3Transformer2DModel

    from flowrl.plan import cost
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
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)

    def per_second(module) -> float:
        with torch.no_grad():
            module(**inputs)
            sync()
            tic = time.perf_counter()
            for _ in range(repeats):
                module(**inputs)
            sync()
        return repeats / (time.perf_counter() - tic)

    base = per_second(model)
    tflop = cost.count_flops(model, **inputs)[0]
    out = {"batch": batch, "latent_side": side, "dtype": str(dtype), "torchao": torchao_installed()}
    out["forward_tflop"] = tflop
    out["eta_bf16_forward"] = tflop * base / cost.HARDWARE[ctx.gpu].bf16
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
    # real FP8 is asked for on an sm_89+ GPU (or with --require-fp8); the fake emulation never stands in for it
    out["fp8_asked"] = ctx.require_fp8 or (ctx.cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9))
    out["fp8_real"] = "fp8" in ran
    if out["fp8_asked"] and not out["fp8_real"]:
        out["error"] = f"real FP8 was asked for and did not run: {out['formats']['fp8']['error']}"
    out["ok"] = len(ran) >= 2 and (out["fp8_real"] or not out["fp8_asked"])
    return out


def sd3_eta(ctx: Context) -> dict:
    """η of the SD3.5-M transformer (float16, LoRA rank 32, checkpointing: build_policy's) at the GRPO micro-batch
    (18 rows of 512 px, 333 text tokens): a forward without grad, and a forward with grad plus its backward, their
    FLOPs counted by FlopCounterMode; the backward's activation memory beside the plan's."""
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    from flowrl.models.lora import JOINT_ATTENTION_TARGETS
    from flowrl.plan import cost

    dtype = torch.float32 if ctx.tiny and not ctx.cuda else torch.float16
    if ctx.tiny:
        from diffusers import SD3Transformer2DModel

        model = SD3Transformer2DModel.from_pretrained(f"{model_source(ctx, 'sd3')}/transformer").to(ctx.device, dtype)
        rows, side, text = 4, 4, 8
    else:
        with archs.seeded(ctx.device), archs.building(ctx.device, dtype):
            model = archs.transformer("sd3")
        rows, side, text = 18, 64, 333
    targets = list(JOINT_ATTENTION_TARGETS)
    model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=targets))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if p.requires_grad:
            p.data = p.data.float()
    model.enable_gradient_checkpointing()
    c = model.config
    inputs = dict(
        hidden_states=torch.randn(rows, c.in_channels, side, side, device=ctx.device, dtype=dtype),
        encoder_hidden_states=torch.randn(rows, text, c.joint_attention_dim, device=ctx.device, dtype=dtype),
        pooled_projections=torch.randn(rows, c.pooled_projection_dim, device=ctx.device, dtype=dtype),
        timestep=torch.full((rows,), 500.0, device=ctx.device),
        return_dict=False,
    )
    autocast = torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32)
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)

    def forward():
        with torch.no_grad(), autocast:
            return model(**inputs)

    def train():
        with autocast:
            out = model(**inputs)[0]
        out.float().square().mean().backward()

    forward(), train()  # warm-up
    model.zero_grad(set_to_none=True)
    timings = {}
    for label, fn, repeats in (("forward", forward, 3), ("train", train, 2)):
        sync()
        before = torch.cuda.memory_allocated() if ctx.cuda else 0
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        tic = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        timings[label] = (time.perf_counter() - tic) / repeats
        if label == "train" and ctx.cuda:
            timings["activation_peak_GiB"] = (torch.cuda.max_memory_allocated() - before) / GIB
    with FlopCounterMode(display=False) as counter:
        forward()
    forward_tflop = counter.get_total_flops() / 1e12
    with FlopCounterMode(display=False) as counter:
        train()
    train_tflop = counter.get_total_flops() / 1e12
    peak = cost.HARDWARE[ctx.gpu].bf16
    out = {
        "rows": rows,
        "latent_side": side,
        "text_tokens": text,
        "dtype": str(dtype),
        "gpu": ctx.gpu,
        "forward_s": timings["forward"],
        "train_s": timings["train"],
        "forward_tflop": forward_tflop,
        "train_tflop": train_tflop,
        "train_over_forward_flops": train_tflop / forward_tflop,
        "eta_forward": forward_tflop / timings["forward"] / peak,
        "eta_train": train_tflop / timings["train"] / peak,
        "activation_peak_GiB": timings.get("activation_peak_GiB"),
    }
    out["ok"] = forward_tflop > 0 and train_tflop > forward_tflop
    return out


def sd3_loader(ctx: Context) -> dict:
    """SD3.5-M with its full-size text encoders through build_policy: dtypes, devices, fp32 LoRA, checkpointing."""
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
        "memory_allocated_GiB": torch.cuda.memory_allocated() / GIB if ctx.cuda else None,
        "real_size_on_meta": archs.count_params("sd3", ctx.tmp / "meta" / "sd3"),
    }
    on_device = all(ctx.device.type in d for c in out["components"].values() for d in c["devices"])
    out["all_on_device"] = on_device
    out["ok"] = bool(lora) and out["lora_all_float32"] and out["gradient_checkpointing"] and on_device
    return out


def sd3_grpo(ctx: Context) -> dict:
    """Two GRPO steps of configs/sd3/grpo_pickscore.yaml at one minibatch of one GPU's batch, in deterministic mode (the
    straight half of the resume pair): ratio 1, η and peaks per phase; the step-1 checkpoint for sd3_resume."""
    from flowrl.trainers.grpo import GRPOTrainer
    from flowrl.training.loop import save_recipe

    cfg, notes = sd3_config(ctx), []
    with deterministic(notes):
        trainer, steps = GRPOTrainer(cfg), ctx.shared.setdefault("partial", {}).setdefault("steps", [])
        with FirstPass(ctx, trainer) as first:
            for i in range(2):
                steps.append(first.step())
                if i == 0:
                    ctx.shared["sd3_checkpoint"] = str(save_recipe(trainer))
    ctx.shared["sd3_weights"], ctx.shared["sd3_cfg"] = trainable(trainer), cfg
    ctx.shared["nondeterministic_ops"] = notes
    return {
        "local_samples": trainer.parts.local_n,
        "deterministic": True,
        "nondeterministic_ops": notes,
        "steps": steps,
        "peak_GiB": steps[-1]["peak_GiB"],
        "eta": eta_per_phase(ctx, SD3_YAML, sd3_sizes(ctx), steps[-1]),
        "ok": all(s["first_pass_ratio_exactly_1"] for s in steps),
    }


def sd3_resume(ctx: Context) -> dict:
    """A fresh trainer resumes from sd3_grpo's step-1 checkpoint in deterministic mode; its step-2 weights must equal
    the straight run's bit for bit (a difference is a resume bug unless an op was named nondeterministic)."""
    from flowrl.trainers.grpo import GRPOTrainer
    from flowrl.training.loop import resume_recipe

    if "sd3_checkpoint" not in ctx.shared or "sd3_weights" not in ctx.shared:
        raise RuntimeError("needs section sd3_grpo's step-1 checkpoint and step-2 weights, which it did not produce")
    notes = []
    with deterministic(notes):
        trainer = GRPOTrainer(ctx.shared["sd3_cfg"])
        resume_recipe(trainer, ctx.shared["sd3_checkpoint"])
        with FirstPass(ctx, trainer) as first:
            step = first.step()
    resumed, straight = trainable(trainer), ctx.shared["sd3_weights"]
    differ = [n for n in straight if n not in resumed or not torch.equal(straight[n], resumed[n])]
    diff = max((float((straight[n] - resumed[n]).abs().max()) for n in differ if n in resumed), default=0.0)
    equal = not differ and len(resumed) == len(straight)
    return {
        "checkpoint": ctx.shared["sd3_checkpoint"],
        "step_after_resume": trainer.parts.step,
        "deterministic": True,
        "nondeterministic_ops": sorted(set(notes) | set(ctx.shared.get("nondeterministic_ops", []))),
        "tensors": len(straight),
        "tensors_differing": len(differ),
        "max_abs_difference": diff,
        "bitwise_equal": equal,
        "step": step,
        "ok": equal and trainer.parts.step == 2,
    }


def prompt_cache(ctx: Context) -> dict:
    """Bytes a cached prompt holds (embeddings with the CFG negative, on the model's device), and encode time."""
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
        "MiB_per_prompt": cache.nbytes / len(cache) / 2**20,
        "entry": {k: [list(v.shape), str(v.dtype)] for k, v in entry.items() if isinstance(v, torch.Tensor)},
        "encode_s_per_prompt": seconds / len(prompts),
        "max_sequence_length": model.max_sequence_length,
        "ok": len(cache) == len(set(prompts)) and cache.nbytes > 0,
    }


def recipe_step(ctx: Context, yaml_path: str, family: str, real: dict, tiny: dict, name: str, first_pass: bool) -> dict:
    """One measured step of the config's own recipe: perf/*, η and peaks per phase, the first pass (GRPO)."""
    from flowrl.trainers import build_trainer

    cfg = run_config(ctx, yaml_path, family, real, tiny, name)
    trainer = build_trainer(cfg)
    if first_pass:
        with FirstPass(ctx, trainer) as first:
            step = first.step()
    else:
        step = measured_step(ctx, trainer)
    out = {"trainer": cfg.trainer, "local_samples": trainer.parts.local_n, "step": step, "peak_GiB": step["peak_GiB"]}
    out["components"] = _components(trainer.parts.model)
    out["eta"] = eta_per_phase(ctx, yaml_path, tiny if ctx.tiny else real, step)
    loss = step.get("train/loss")
    out["ok"] = step["first_pass_ratio_exactly_1"] if first_pass else loss is not None and loss == loss
    return out


NFT_YAML, AWM_YAML = "configs/sd3/nft_pickscore.yaml", "configs/sd3/awm_pickscore.yaml"
ONE_MINIBATCH = {"train.num_minibatches": 1, "train.num_rollout_batches": 1, "train.gradient_accumulation_steps": 1}
NFT_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 8, **ONE_MINIBATCH}
AWM_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 8, **ONE_MINIBATCH}
AWM_TINY = {**SD3_TINY, "train.num_train_timesteps": 2}


def sd3_nft(ctx: Context) -> dict:
    """One DiffusionNFT step of configs/sd3/nft_pickscore.yaml at SD3.5-M size (1 prompt x 8, 9 trained times)."""
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    return recipe_step(ctx, NFT_YAML, "sd3", {**NFT_REAL, **reward}, {**SD3_TINY, **reward}, "gpu_check_nft", False)


def nft_async(ctx: Context) -> dict:
    """NFT's asynchronous rollout on the device, its worker thread on its own CUDA stream (the tiny SD3 sizes in both
    modes): two steps forced to staleness 0 end on the synchronous run's weights (torch.equal, deterministic mode);
    one-step-stale steps are the CPU tests' (docs/math.md#asynchronous-nft)."""
    import dataclasses

    from flowrl.trainers import build_trainer

    small = dataclasses.replace(ctx, tiny=True)
    sizes = {**SD3_TINY, "num_steps": 2, "train.decay_type": 0, "checkpoint.every_n_steps": 0}
    sizes["rewards"] = [{"name": "pickscore", "weight": 1.0, **pickscore(small)}]
    runs, record = {}, []
    with deterministic(record):
        for name, extra in (("sync", {}), ("forced", {"train.async_rollout": True, "train.async_staleness": 0})):
            trainer = build_trainer(run_config(small, NFT_YAML, "sd3", {}, {**sizes, **extra}, f"gpu_check_{name}"))
            runs[name] = (trainer, [trainer.train_step().get("train/staleness") for _ in range(2)])
    sync, forced = runs["sync"][0], runs["forced"][0]
    equal = all(torch.equal(a, b) for a, b in zip(sync.parts.opt.params, forced.parts.opt.params))
    streams = forced.ahead._stream is not None
    out = {"bitwise_equal": equal, "staleness": runs["forced"][1], "cuda_stream": streams}
    out["ok"] = equal and runs["forced"][1] == [0.0, 0.0] and streams == ctx.cuda
    return out | {"nondeterministic_ops": record}


def sd3_awm(ctx: Context) -> dict:
    """One AWM step of configs/sd3/awm_pickscore.yaml at SD3.5-M size (1 prompt x 8, 14 steps, 6 trained times)."""
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    return recipe_step(ctx, AWM_YAML, "sd3", {**AWM_REAL, **reward}, {**AWM_TINY, **reward}, "gpu_check_awm", False)


EVAL = {"eval.num_prompts": 2, "eval.seeds": [0, 1]}


def sd3_eval(ctx: Context) -> dict:
    """One evaluation pass of configs/sd3/grpo_pickscore.yaml's eval (40 steps, CFG 4.5, PickScore) on 2 prompts x 2
    seeds at 512 px: seconds per image, peak memory."""
    from flowrl.trainers.grpo import GRPOTrainer

    tiny_eval = {"eval.num_steps": 3} if ctx.tiny else {}
    trainer = GRPOTrainer(sd3_config(ctx, "gpu_check_eval", extra={**EVAL, **tiny_eval}))
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    result = trainer.parts.evaluation(None)
    if ctx.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - tic
    images = EVAL["eval.num_prompts"] * len(EVAL["eval.seeds"])
    scores = {k: v for k, v in (result or {}).items() if isinstance(v, int | float)}
    return {
        "images": images,
        "seconds": seconds,
        "seconds_per_image": seconds / images,
        "peak_GiB": {"eval": torch.cuda.max_memory_allocated() / GIB} if ctx.cuda else None,
        "scores": scores,
        "ok": result is not None,
    }


FSDP_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 2, "sampler.num_steps": 4, **ONE_MINIBATCH}


def sd3_fsdp(ctx: Context) -> dict:
    """A one-process FSDP2 run of configs/sd3/grpo_pickscore.yaml (1 prompt x 2, 4 steps): step 1, save, step 2; a fresh
    trainer resumes the checkpoint and its step 2 must equal bit for bit (deterministic mode). Runs in a child process
    with accelerate's FSDP environment (a process's accelerate state is set once)."""
    if os.environ.get(FSDP_CHILD) != "1":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        out = ctx.tmp / "fsdp_child"
        command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out), "--sections", "sd3_fsdp"]
        command += ["--device", str(ctx.device), *(["--tiny"] if ctx.tiny else [])]
        env = {**os.environ, **FSDP_ENV, "MASTER_PORT": port, FSDP_CHILD: "1"}
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=max(5, ctx.shared.get("budget_s", 600) - 2)
        )
        sections_file = out / "sections.json"
        if not sections_file.is_file():
            tail = done.stderr.strip()[-300:]
            raise RuntimeError(f"the FSDP child wrote no results (exit {done.returncode}): {tail}")
        return json.loads(sections_file.read_text())["sd3_fsdp"]
    from flowrl.trainers.grpo import GRPOTrainer
    from flowrl.training.distributed import Sharding, _fsdp_on_cpu, make_accelerator
    from flowrl.training.loop import resume_recipe, save_recipe

    cfg, notes = sd3_config(ctx, "gpu_check_fsdp", extra=FSDP_REAL if not ctx.tiny else None), []
    acc = make_accelerator(cfg)
    if not ctx.cuda:  # accelerate enters FSDP by itself on accelerators only; flowrl's gloo path (distributed.py)
        _fsdp_on_cpu(acc)
    with one_process_fsdp(), deterministic(notes):
        trainer = GRPOTrainer(cfg, accelerator=acc)
        sharding = Sharding(trainer.parts.accelerator).kind
        first = measured_step(ctx, trainer)
        checkpoint = save_recipe(trainer)
        second = measured_step(ctx, trainer)
        straight = trainable(trainer)
        del trainer
        if ctx.cuda:
            torch.cuda.empty_cache()
        resumed_trainer = GRPOTrainer(cfg, accelerator=acc)
        resume_recipe(resumed_trainer, checkpoint)
        resumed_step = measured_step(ctx, resumed_trainer)
        resumed = trainable(resumed_trainer)
    equal = straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    diff = max((float((straight[k] - resumed[k]).abs().max()) for k in straight if k in resumed), default=0.0)
    return {
        "sharding": sharding,
        "steps": [first, second],
        "resumed_step": resumed_step,
        "peak_GiB": second["peak_GiB"],
        "nondeterministic_ops": notes,
        "bitwise_equal": equal,
        "max_abs_difference": diff,
        "eta": eta_per_phase(ctx, SD3_YAML, SD3_TINY if ctx.tiny else FSDP_REAL, second),
        "ok": sharding == "fsdp" and equal and resumed_trainer.parts.step == 2,
    }


def reward_models(ctx: Context) -> dict:
    """PickScore, HPSv2, ImageReward and HPSv3 built at their real sizes with random weights (scripts/_gpu_archs.py)
    scoring a batch of 8 images at 512 px: build seconds, seconds per image (the best of 2 calls after a warm-up)."""
    from flowrl.registry import REWARDS

    n, side = (2, 32) if ctx.tiny else (8, 512)
    images = torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    prompts = [f"a photo of {i} red cats on a sign" for i in range(n)]
    out, ok = ctx.shared.setdefault("partial", {}), True  # a timeout keeps the rewards measured before it
    out.update(images=n, side=side)
    for name in ("pickscore", "hpsv3", "imagereward", "hpsv2"):
        tic = time.perf_counter()
        try:
            with archs.reward_weights(name, ctx.tmp / "rewards" / name, ctx.device, ctx.tiny) as kwargs:
                reward = REWARDS.build(name, device=ctx.device, **kwargs)
                build_s = time.perf_counter() - tic
                with torch.no_grad():
                    reward(images, prompts, [{} for _ in prompts])
                    calls = []
                    for _ in range(2):
                        if ctx.cuda:
                            torch.cuda.synchronize()
                        tic = time.perf_counter()
                        scores = reward(images, prompts, [{} for _ in prompts]).scores
                        if ctx.cuda:
                            torch.cuda.synchronize()
                        calls.append(time.perf_counter() - tic)
            modules = [m for m in vars(reward).values() if isinstance(m, torch.nn.Module)]
            out[name] = {
                "build_s": build_s,
                "seconds_per_image": min(calls) / n,
                "params_B": sum(p.numel() for m in modules for p in m.parameters()) / 1e9,
                "dtype": str(kwargs.get("dtype", torch.float32)),
                "finite": bool(torch.isfinite(scores).all()),
            }
            ok = ok and out[name]["finite"]
            del reward
        except Exception as err:  # noqa: BLE001 - each reward records why it did not run; the next one runs
            out[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
            ok = False
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    out["ok"] = ok
    return out


FLUX_YAML = "configs/flux/grpo_hpsv2.yaml"
FLUX_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 2, "train.timestep_fraction": 0.125}


def flux_step(ctx: Context) -> dict:
    """One FLUX.1-dev step of configs/flux/grpo_hpsv2.yaml at 720 px, 16 steps (1 prompt x 2, 2 trained transitions);
    PickScore stands in for HPSv2 (the same ViT-H-14)."""
    reward = {"rewards": [{"name": "pickscore", "weight": 1.0, **pickscore(ctx)}]}
    out = recipe_step(ctx, FLUX_YAML, "flux", {**FLUX_REAL, **reward}, {**SD3_TINY, **reward}, "gpu_check_flux", True)
    out["real_size_on_meta"] = archs.count_params("flux", ctx.tmp / "meta" / "flux")
    return out


WAN_YAML = "configs/wan/grpo_video.yaml"
WAN_REAL = {"data.num_prompts_per_step": 1, "data.group_size": 2, "train.timestep_fraction": 0.1}
WAN_TINY = {
    **SD3_TINY,
    "sampler.height": 16,
    "sampler.width": 16,
    "sampler.num_frames": 5,
    "train.gradient_accumulation_steps": 1,
}


def wan_step(ctx: Context) -> dict:
    """One Wan2.1-1.3B step of configs/wan/grpo_video.yaml at 480x832x33, 20 steps, with its video rewards (1 prompt
    x 2, 2 trained transitions)."""
    rewards = {"rewards": video_rewards(ctx)}
    out = recipe_step(ctx, WAN_YAML, "wan", {**WAN_REAL, **rewards}, {**WAN_TINY, **rewards}, "gpu_check_wan", True)
    out["real_size_on_meta"] = archs.count_params("wan", ctx.tmp / "meta" / "wan")
    return out


def wan22_step(ctx: Context) -> dict:
    """The tiny Wan 2.2 A14B pipeline (two experts, the high-noise one trains) for one step on this device."""
    tiny = ctx if ctx.tiny else Context(True, ctx.device, ctx.tmp / "tiny_rewards")  # the tiny model, tiny rewards
    sizes = {**WAN_TINY, "sampler.num_steps": 4, "rewards": video_rewards(tiny)}
    cfg = run_config(ctx, "configs/wan/grpo_video_wan22_a14b.yaml", "wan22", sizes, sizes, "gpu_check_wan22")
    from flowrl.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    with FirstPass(ctx, trainer) as first:
        step = first.step()
    experts = {k: v for k, v in _components(trainer.parts.model).items() if k.startswith("transformer")}
    on_device = len(experts) == 2 and all(ctx.device.type in d for e in experts.values() for d in e["devices"])
    return {
        "step": step,
        "experts": experts,
        "experts_on_device": on_device,
        "ok": step["first_pass_ratio_exactly_1"] and on_device,
    }


# name -> (function, `flowrl plan` job: (config, sizes real, sizes tiny, sharding) or None); the order and the time
# budgets are gpu_check.py's SECTIONS
FUNCTIONS = {
    "preview_speed": (preview_speed, None),
    "sd3_eta": (sd3_eta, (SD3_YAML, SD3_REAL, SD3_TINY, "none")),
    "sd3_loader": (sd3_loader, None),
    "sd3_grpo": (sd3_grpo, (SD3_YAML, SD3_REAL, SD3_TINY, "none")),
    "sd3_resume": (sd3_resume, (SD3_YAML, SD3_REAL, SD3_TINY, "none")),
    "prompt_cache": (prompt_cache, None),
    "wan22_step": (wan22_step, None),
    "sd3_nft": (sd3_nft, (NFT_YAML, NFT_REAL, SD3_TINY, "none")),
    "nft_async": (nft_async, None),
    "sd3_awm": (sd3_awm, (AWM_YAML, AWM_REAL, AWM_TINY, "none")),
    "sd3_fsdp": (sd3_fsdp, (SD3_YAML, FSDP_REAL, SD3_TINY, "fsdp")),
    "sd3_eval": (sd3_eval, None),
    "reward_models": (reward_models, None),
    "flux_step": (flux_step, (FLUX_YAML, FLUX_REAL, SD3_TINY, "none")),
    "wan_step": (wan_step, (WAN_YAML, WAN_REAL, WAN_TINY, "none")),
}


def plan_job(name: str, tiny: bool) -> tuple[str, list[str], str] | None:
    """(config, overrides, sharding) of the `flowrl plan` estimate beside section `name`'s peaks (None: no plan)."""
    job = FUNCTIONS[name][1]
    if job is None:
        return None
    yaml_path, real, small, sharding = job
    return yaml_path, plan_overrides(yaml_path, small if tiny else real), sharding
