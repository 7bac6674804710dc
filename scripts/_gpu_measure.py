"""The instruments of scripts/gpu_check.py's sections: the check's context, the parts a section builds (model folders,
rewards, run configs), and what a training step records (`measured_step`): the recipe's perf/* seconds, the work
meter's counts, the efficiency η per phase (the counts priced at η = 1 by flowrl.plan.cost, over the measured
seconds) and the peak CUDA memory per phase in GiB (`rollout`: stages 1-5 with the rewards scored beside the
rollout; `train`: stage 6), which gpu_check.py sets beside `flowrl plan`'s estimate for the same batch
(`plan_estimate`, computed in a worker process while the sections run)."""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import _gpu_archs as archs
import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
TINY_FAMILY = {"sd3": "sd3", "flux": "flux", "wan": "wan", "wan22": "wan22_a14b"}
FSDP_CHILD = "FLOWRL_GPU_CHECK_FSDP"  # set in the child process that runs sd3_fsdp's one-process FSDP2 run


@dataclass
class Context:
    tiny: bool
    device: torch.device
    tmp: Path
    shared: dict = field(default_factory=dict)
    require_fp8: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def gpu(self) -> str:
        """The hardware table's row that prices this device's work (flowrl.plan.cost.HARDWARE); h100 on a CPU."""
        name = torch.cuda.get_device_name(self.device).upper() if self.cuda else ""
        return next((key for key in ("h200", "b200", "h100") if key.upper() in name), "h100")


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
        {"name": "per_frame", "weight": 1.0, "reward": "pickscore", "reward_config": pickscore(ctx), "reduce": "mean",
         "every_k_frames": every},
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


def plan_overrides(yaml_path: str, sizes: dict) -> list[str]:
    """The dotlist `flowrl plan` takes for the batch a section runs (the sizes; not the model folder or rewards)."""
    from flowrl.config import read_config_data

    prompts = ROOT / read_config_data(ROOT / yaml_path)["data"]["prompts_file"]
    scalars = {k: v for k, v in sizes.items() if not isinstance(v, list | dict) or k.startswith("eval.")}
    dotlist = [f"{k}={json.dumps(v)}" for k, v in scalars.items()]
    return [f"data.prompts_file={prompts}", *dotlist]


def plan_estimate(yaml_path: str, overrides: list[str], sharding: str = "none") -> dict:
    """`flowrl plan`'s peak memory per GPU (GiB, by part) of `yaml_path` with `overrides` on one GPU."""
    from flowrl.plan import memory, plan
    from flowrl.trainers import load_config

    plan._quiet()
    cfg = load_config(ROOT / yaml_path, overrides)
    mem = plan.memory_plan(cfg, plan.geometry(cfg), 1, sharding)
    peak = memory.estimate_peak(mem)
    peak.pop("trainable_params")
    return {"rows": mem.rows, "sharding": sharding, "peak_GiB": peak}


def compare_with_plan(result: dict, estimate: dict) -> dict:
    """The measured peaks beside the plan's estimate: the train phase's allocated peak over the plan's total less its
    overhead (the CUDA context and fragmentation that torch.cuda.max_memory_allocated does not see); for sd3_eta the
    backward's activations over the plan's activations + transient."""
    peak = estimate["peak_GiB"]
    out = {"plan_peak_GiB": peak, "plan_rows": estimate["rows"]}
    allocated = peak["total"] - peak["overhead"]
    train = (result.get("peak_GiB") or {}).get("train")
    if train is not None:
        out["train_over_plan"] = train / allocated
    if result.get("activation_peak_GiB") is not None:
        out["activations_over_plan"] = result["activation_peak_GiB"] / (peak["activations"] + peak["transient"])
    return out


def trainable(trainer) -> dict[str, torch.Tensor]:
    from flowrl.training.distributed import full

    return {n: full(p).float() for n, p in trainer.parts.model.transformer.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def deterministic(record: list):
    """torch.use_deterministic_algorithms(True) (warn_only: an op without a deterministic kernel is named in `record`
    instead of raising), with CUBLAS_WORKSPACE_CONFIG set by gpu_check.py before CUDA starts."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])
            named = {str(w.message).splitlines()[0][:200] for w in caught if "determinis" in str(w.message)}
            record.extend(sorted(named))


@contextlib.contextmanager
def phase_peaks(ctx: Context, peaks: dict):
    """Record the peak CUDA memory (GiB) at the end of every flowrl.work phase block (the recipes' `rollout`), then
    reset the counter, so the next phase starts from what is held."""
    import flowrl.work as work

    original = work.phase

    @contextlib.contextmanager
    def measured(name: str):
        with original(name):
            yield
        if ctx.cuda:
            torch.cuda.synchronize()
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / GIB)
            torch.cuda.reset_peak_memory_stats()

    work.phase = measured
    try:
        yield peaks
    finally:
        work.phase = original


def measured_step(ctx: Context, trainer) -> dict:
    """One training step through the run loop's metered_step: perf/*, the work meter's counts, peaks per phase."""
    from flowrl.training.loop import metered_step

    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peaks: dict = {}
    tic = time.perf_counter()
    with phase_peaks(ctx, peaks):
        metrics = metered_step(trainer)
    keep = ("perf/", "train/ratio", "train/loss", "train/optimizer", "work/")
    out = {k: float(v) for k, v in metrics.items() if k.startswith(keep)}
    out["seconds"] = time.perf_counter() - tic
    if ctx.cuda:
        peaks["train"] = torch.cuda.max_memory_allocated() / GIB  # since the rollout phase ended
        out["reserved_GiB"] = torch.cuda.max_memory_reserved() / GIB
    out["peak_GiB"] = peaks or None
    return out


def eta_per_phase(ctx: Context, yaml_path: str, sizes: dict, step: dict) -> dict:
    """η per phase: the step's work meter counts priced at η = 1 on this GPU's row of the hardware table (the config's
    real geometry; flowrl.plan.cost) over the measured seconds (perf/rollout_s counts the wait for the scoring that
    overlaps the rollout; score: perf/reward_s; train: perf/optimise_s; step: perf/step_s)."""
    from flowrl.plan import cost, plan
    from flowrl.trainers import load_config

    cfg = load_config(ROOT / yaml_path, plan_overrides(yaml_path, sizes))
    geo = plan.geometry(cfg)
    rewards = tuple(r.name for r in cfg.rewards)
    size = cost.real_size(geo.family, geo.height, geo.width, geo.num_frames, geo.text_tokens, rewards)
    priced = cost.price({k: v for k, v in step.items() if k.startswith("work/")}, size, ctx.gpu, 1.0)
    measured = {"rollout": step["perf/rollout_s"], "score": step["perf/reward_s"], "train": step["perf/optimise_s"]}
    eta = {p: priced["by_phase"].get(p, 0.0) / s for p, s in measured.items() if s > 0}
    eta["step"] = priced["seconds"] / step["perf/step_s"]
    return {"gpu": ctx.gpu, "eta": eta, "seconds_at_eta_1": priced["by_phase"], "tflop": priced["tflop"]}


class FirstPass:
    """Records the ratios of every transition recomputed before the step's first optimizer step (the first pass,
    whose ratio must be exactly 1) by wrapping the clipped_policy_loss GRPO's ratio control calls
    (trainers/guard.py)."""

    def __init__(self, ctx: Context, trainer):
        self.ctx, self.trainer, self.ratios, self.start = ctx, trainer, [], 0

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
        """One measured training step and the first pass's ratios."""
        self.ratios, self.start = [], self.trainer.parts.opt.optimizer_steps
        out = measured_step(self.ctx, self.trainer)
        ratios = torch.cat(self.ratios) if self.ratios else torch.ones(0)
        out["first_pass_transitions"] = int(ratios.numel())
        out["first_pass_ratio_min"] = float(ratios.min()) if ratios.numel() else None
        out["first_pass_ratio_max"] = float(ratios.max()) if ratios.numel() else None
        out["first_pass_ratio_exactly_1"] = bool(ratios.numel() and (ratios == 1).all())
        return out


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


FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
}  # fmt: skip  (what `accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1` sets)


@contextlib.contextmanager
def one_process_fsdp():
    """flowrl shards only across processes (`Sharding`: one process is data parallel); here one process launched
    with FSDP2 shards too, so FSDP2's code (fully_shard, sharded gradients and optimizer state, the full-state gather
    of a checkpoint) runs on one GPU at real size."""
    from flowrl.training.distributed import Sharding

    original = Sharding.__init__

    def sharded(self, accelerator):
        original(self, accelerator)
        if self.kind is None and accelerator.distributed_type.name == "FSDP" and accelerator.is_fsdp2:
            self.kind = "fsdp"

    Sharding.__init__ = sharded
    try:
        yield
    finally:
        Sharding.__init__ = original
