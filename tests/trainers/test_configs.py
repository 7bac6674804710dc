"""Every shipped config loads; each real-model config runs one step of its recipe on its family's tiny pipeline."""

from pathlib import Path

import pytest
import yaml

from flowrl.rewards._tiny import TINY_REWARDS
from flowrl.trainers import build_trainer, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)
REAL = {
    "sd3": "configs/sd3/grpo_pickscore.yaml",
    "flux": "configs/flux/grpo_hpsv2.yaml",
    "sana": "configs/sana/grpo_imagereward.yaml",
    "wan": "configs/wan/grpo_video.yaml",
    "sd3-nft": "configs/sd3/nft_pickscore.yaml",
    "sd3-marble": "configs/sd3/marble_five_rewards.yaml",
    "flux-nft": "configs/flux/nft_hpsv2.yaml",
    "flux-branchgrpo": "configs/flux/branchgrpo_hpsv2.yaml",
    "wan-branchgrpo": "configs/wan/branchgrpo_video.yaml",
    "qwen_image": "configs/qwen_image/grpo_pickscore.yaml",
    "flux2_klein": "configs/flux2/grpo_hpsv2.yaml",
    "flux2_dev": "configs/flux2/grpo_hpsv2_dev.yaml",
    "z_image": "configs/z_image/grpo_pickscore.yaml",
    "qwen_image_edit": "configs/qwen_image_edit/grpo_edit.yaml",
    "wan_i2v": "configs/wan22/grpo_i2v.yaml",
    "wan_i2v-tagrpo": "configs/wan22/tagrpo_i2v.yaml",
    "wan22_a14b": "configs/wan/grpo_video_wan22_a14b.yaml",
    "wan22_ti2v": "configs/wan/grpo_video_wan22_ti2v.yaml",
    "ltx2": "configs/ltx2/grpo_video.yaml",
    "sd3-ram": "configs/sd3/ram_pickscore.yaml",
    "sd3-awm": "configs/sd3/awm_pickscore.yaml",
    "sd3-dgpo": "configs/sd3/dgpo_pickscore.yaml",
    "sd3-gdro": "configs/sd3/gdro_pickscore.yaml",
    "sd3-adv_grpo": "configs/sd3/adv_grpo_dino.yaml",
    "sd3-smopd": "configs/sd3/smopd_pickscore_ocr.yaml",
    "sd3-ram_ocr": "configs/sd3/ram_ocr.yaml",
    "flux-ram": "configs/flux/ram_hpsv2.yaml",
    "sd3-adjoint_matching": "configs/sd3/adjoint_matching_imagereward.yaml",
    "sd3-solrl": "configs/sd3/solrl.yaml",
    "flux-solrl": "configs/flux/solrl.yaml",
    "sana-solrl": "configs/sana/solrl.yaml",
    "wan-cachedsearch": "configs/wan/cachedsearch.yaml",
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_loads_and_starts_with_its_launch_command(path):
    text = path.read_text()
    assert text.lstrip().startswith("#") and ("accelerate launch" in text or "flowrl" in text)
    cfg = load_config(path, [f"data.prompts_file={ROOT / cfg_file}" for cfg_file in _prompt_files(text)])
    assert cfg.rewards and cfg.num_steps > 0


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_preset_parses_and_shows_its_launch_command(path):
    from accelerate.commands.config.config_args import load_config_from_file

    text = path.read_text()
    assert text.lstrip().startswith("#") and "accelerate launch" in text
    preset = load_config_from_file(str(path))
    expected = {
        "single_gpu": "NO",
        "multi_gpu": "MULTI_GPU",
        "cpu_2proc": "MULTI_GPU",
        "fsdp": "FSDP",
        "deepspeed_zero2": "DEEPSPEED",
    }[path.stem]
    assert preset.distributed_type.name == expected
    if expected == "FSDP":
        assert preset.fsdp_config["fsdp_version"] == 2  # flowrl refuses FSDP1
    if expected == "DEEPSPEED":
        assert preset.deepspeed_config["zero_stage"] == 2


def _prompt_files(text: str) -> list[str]:
    data = yaml.safe_load(text)
    return [data["data"]["prompts_file"]] if data.get("data", {}).get("prompts_file") else []


def tiny_reward_kwargs(spec: dict, folder: Path) -> dict:
    if spec["name"] == "per_frame":
        return {**spec, "reward_config": TINY_REWARDS[spec["reward"]](folder / spec["reward"])}
    return {**spec, **TINY_REWARDS[spec["name"]](folder / spec["name"])}


OWN_METRIC = {  # a metric only the recipe's own stage 6 logs
    "grpo": "train/ratio_mean",
    "nft": "train/positive_loss",
    "ram": "train/target_norm",
    "awm": "train/weighted_error",
    "dgpo": "train/group_weight",
    "gdro": "train/top1_match",
    "adv_grpo": "train/rm_loss",
    "smopd": "train/distill_loss",
    "adjoint_matching": "train/grad_reward_norm",
    "tagrpo": "train/tagrpo_bank_entries",
}


@pytest.mark.parametrize("family", list(REAL))
def test_real_config_runs_one_step_on_the_tiny_pipeline(family, tiny_pipeline, tmp_path):
    path = ROOT / REAL[family]
    family = family.split("-")[0]
    data = yaml.safe_load(path.read_text())
    rewards = [tiny_reward_kwargs(spec, tmp_path / "rewards") for spec in data["rewards"]]
    frames = ["sampler.num_frames=5"] if family.startswith("wan") else []
    if "sde_window_size" in data["sampler"]:  # keep the window inside the shortened trajectory
        frames += ["sampler.sde_window_size=1", "sampler.sde_window_range=[0, 2]"]
    if "split_steps" in data["sampler"]:  # a tree of group_size = 2 leaves inside the 3 steps
        frames += ["sampler.split_steps=[0]", "sampler.branching=2"]
    if data["sampler"]["name"] == "candidates":  # small pools; the fake (exact) NVFP4 on the CPU
        backend = data["sampler"]["preview_backend"].replace("nvfp4", "fake_nvfp4")
        frames += ["sampler.pool_size=3", "sampler.preview_num_steps=2", f"sampler.preview_backend={backend}"]
        if "cached" in backend and family == "wan":  # the tiny Wan has one block: FirstBlockCache needs two
            frames += ["sampler.preview_cache={type: taylorseer}"]
    size = 16 if family.startswith("wan") else 32
    if data.get("trainer") == "adv_grpo":  # the RM on the tiny DINOv2, one reference image for every prompt
        tiny = TINY_REWARDS["dino_similarity"](tmp_path / "rm")
        table = tmp_path / "rm" / "references.json"
        prompts = (ROOT / data["data"]["prompts_file"]).read_text().splitlines()
        table.write_text(
            __import__("json").dumps(dict.fromkeys(prompts, tiny["references"]))
        )  # the JSON the recipe reads
        frames += [f"train.adversarial.backbone={tiny['model']}", f"train.adversarial.references={table}"]
    if data.get("trainer") == "smopd":  # one step per teacher
        frames += ["train.teacher_steps=1"]
    if family == "ltx2":  # 5 frames; LTX2Pipeline needs multiples of 32; 16 text tokens (2 x the connectors' registers)
        frames += ["sampler.num_frames=5", "model.max_sequence_length=16"]
    if family == "wan_i2v":  # its sources have 832x480's aspect ratio: the nearest tiny size, 80x48
        frames += ["sampler.width=80"]
        size = 48
    cfg = load_config(
        path,
        [
            f"model.path={tiny_pipeline(family)}",
            "model.dtype=float32",
            "model.mixed_precision=fp32",
            "model.lora_rank=4",
            "device=cpu",
            f"output_dir={tmp_path / 'runs'}",
            f"data.prompts_file={ROOT / data['data']['prompts_file']}",
            "data.num_prompts_per_step=2",
            "data.group_size=2",
            "sampler.num_steps=3",
            f"sampler.height={size}",
            f"sampler.width={size}",
            "train.num_minibatches=2",
            "train.gradient_accumulation_steps=1",
            "train.num_rollout_batches=1",
            "logging.trackers=[]",
            f"rewards={yaml.safe_dump(rewards, default_flow_style=True).strip()}",
            *frames,
        ],
    )
    trainer = build_trainer(cfg)
    before = [p.detach().clone() for p in trainer.parts.opt.params]
    metrics = trainer.train_step()
    own = OWN_METRIC[cfg.trainer]
    assert all(k in metrics for k in ("train/loss", own, f"reward/{cfg.rewards[0].name}/mean"))
    assert metrics["train/optimizer_steps"] == 2
    if any(r.name == "image_consistency" for r in cfg.rewards):  # the source image reached the reward through the step
        assert metrics["reward/image_consistency/mean"] == metrics["reward/image_consistency/mean"]  # not NaN
    assert any((a - b).abs().max() > 0 for a, b in zip(before, trainer.parts.opt.params))


@pytest.mark.parametrize(
    "fastest, recipe",
    [
        ("configs/sd3/fastest_pickscore.yaml", "configs/sd3/ram_pickscore.yaml"),
        ("configs/flux/fastest_hpsv2.yaml", "configs/flux/ram_hpsv2.yaml"),
    ],
)
def test_real_fastest_configs_are_the_winning_recipe_whose_one_step_runs_above(fastest, recipe):
    """[compose]'s search on seeds 0-2 picked RAM with ODE rollouts (docs/recipes/compose.md#the-fastest-combination):
    each real-model fastest config is a link to its RAM config (one file to keep), whose one step runs in REAL."""
    path = ROOT / fastest
    assert path.is_symlink() and path.resolve() == (ROOT / recipe).resolve() and recipe in REAL.values()
    assert load_config(path).trainer == "ram" and load_config(path).sampler.name == "ode"


def test_toy_fastest_is_ram_with_half_the_rollout_steps():
    fastest, ram = load_config(ROOT / "configs/toy/fastest.yaml"), load_config(ROOT / "configs/toy/ram.yaml")
    assert (fastest.trainer, fastest.sampler.kwargs["num_steps"], ram.sampler.kwargs["num_steps"]) == ("ram", 4, 8)
    assert {**fastest.sampler.kwargs, "num_steps": 8} == ram.sampler.kwargs and fastest.sampler.name == "ode"
    assert fastest.train == ram.train and fastest.data == ram.data and fastest.rewards == ram.rewards
