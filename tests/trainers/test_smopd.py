"""SMOPD (flowrl/trainers/smopd.py): the distillation target and loss by hand, the teachers' stage (weights, files,
reuse, refusal, billing) and the student's distillation term against the teachers' velocities taken here."""

from __future__ import annotations

import json

import pytest
import torch
from test_trainer_contract import toy_config

from flowrl.losses import blended_velocity, velocity_distill_loss
from flowrl.trainers import build_trainer
from flowrl.trainers.smopd import teacher_config, teacher_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TWO_REWARDS = [{"name": "redness.RednessReward"}, {"name": "redness.RednessReward", "weight": 0.0}]


def test_blended_target_and_loss_by_hand():
    v1 = torch.tensor([[1.0, 2.0], [0.0, -1.0]])  # teacher 1, two samples of two elements
    v2 = torch.tensor([[3.0, -2.0], [4.0, 1.0]])  # teacher 2
    target = blended_velocity(torch.stack([v1, v2]), torch.tensor([0.25, 0.75]))
    assert target.tolist() == [[2.5, -1.0], [3.0, 0.5]]  # 0.25·v1 + 0.75·v2, worked out by hand
    per_sample_mix = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # sample 0 from teacher 1, sample 1 from teacher 2
    assert blended_velocity(torch.stack([v1, v2]), per_sample_mix).tolist() == [[1.0, 2.0], [4.0, 1.0]]

    student = torch.tensor([[2.0, 0.0], [3.0, 1.5]], requires_grad=True)
    plain = velocity_distill_loss(student, target, self_normalised=False)
    assert plain.tolist() == pytest.approx([(0.25 + 1.0) / 2, (0.0 + 1.0) / 2])  # mean of d² per sample
    normalised = velocity_distill_loss(student, target)
    assert normalised.tolist() == pytest.approx([0.625 / 0.75, 0.5 / 0.5])  # ... over mean|d| = 0.75, 0.5

    # the λ-weighted per-teacher loss and the blended target's loss have one gradient (their difference is constant)
    lam = torch.tensor([0.25, 0.75])
    weighted = sum(w * ((student - v) ** 2).sum() for w, v in zip(lam, (v1, v2)))
    (g_weighted,) = torch.autograd.grad(weighted, student)
    (g_blended,) = torch.autograd.grad(((student - target) ** 2).sum(), student)
    assert torch.allclose(g_weighted, g_blended)
    spread = sum(w * ((v - target) ** 2).sum() for w, v in zip(lam, (v1, v2)))
    assert float(weighted.detach()) == pytest.approx(float(((student - target) ** 2).sum().detach() + spread))


def test_teacher_weights_and_config():
    rewards = ["a", "b", "c"]
    assert teacher_weights({"priority": ["b"]}, rewards) == {"a": 0.2, "b": 1.0, "c": 0.2}
    assert teacher_weights({"priority": "a", "others": 0.0}, rewards) == {"a": 1.0, "b": 0.0, "c": 0.0}
    for spec, message in [
        ({"priority": ["z"]}, "unknown: z"),
        ({"priority": []}, "it names none"),
        ({"priorty": ["a"]}, "write {priority"),
    ]:
        with pytest.raises(ValueError, match=message):
            teacher_weights(spec, rewards)


def smopd_config(tmp_path, **overrides):
    base = {
        "rewards": [{"name": "redness.RednessReward"}],
        "sampler": {"name": "ode", "num_steps": 2, "guidance_scale": 1.0},
        "train.teacher_steps": 1,
        "train.timestep_fraction": 0.5,
    }
    return toy_config(tmp_path, "smopd", **{**base, **overrides})


def test_teachers_are_trained_saved_reused_and_refused(tmp_path):
    folder = tmp_path / "teachers"
    cfg = smopd_config(
        tmp_path, **{"train.teacher_dir": str(folder), "train.teachers": [{"priority": ["redness.RednessReward"]}]}
    )
    teacher = teacher_config(cfg, 0, folder)
    assert teacher.trainer == "nft" and teacher.num_steps == 1 and teacher.balancer.name == "gdpo"
    assert not hasattr(teacher.train, "teachers") and teacher.eval.every_n_steps == 0

    trainer = build_trainer(cfg)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["seconds"] > 0 and any(key.startswith("work/rollout/") for key in manifest["work"])
    model = trainer.parts.model
    saved = torch.load(folder / "teacher_0.pt", weights_only=True)
    live = model.adapter_parameters("teacher_0")
    assert {k.replace(".teacher_0.", ".default.") for k in live} == set(saved)
    for name, tensor in live.items():  # the teacher rides on the student's transformer, frozen
        assert torch.equal(tensor, saved[name.replace(".teacher_0.", ".default.")]) and not tensor.requires_grad
    moved = [k for k, v in saved.items() if "lora_B" in k and v.abs().max() > 0]
    assert moved, "the teacher's step left its LoRA B at zero"
    assert all(
        float(p.detach().abs().max()) == 0 for k, p in model.adapter_parameters("default").items() if "lora_B" in k
    )

    # the distillation term at a training time, against the teacher's velocity taken here
    x_t = torch.randn(2, *trainer.parts.model.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.8])
    cond = model.encode(["two red circles"] * 2)
    with torch.no_grad(), model.using_adapter("teacher_0"):
        v_teacher = model.velocity(x_t, sigma, cond, 1.0)
    v_student = model.velocity(x_t, sigma, cond, 1.0)
    d = (v_student - v_teacher).detach()
    expected = d.square().mean((1, 2, 3)) / (d.abs().mean((1, 2, 3)) + 1e-8)
    assert torch.allclose(trainer.distill(x_t, sigma, cond, v_student), expected, rtol=1e-5)

    first = trainer.train_step()  # the teachers' work billed at the first step, once
    assert first["perf/offline_s"] == manifest["seconds"] and first["train/distill_loss"] > 0
    assert "perf/offline_s" not in trainer.train_step()

    stamp = (folder / "teacher_0.pt").stat().st_mtime_ns
    build_trainer(cfg)  # the same settings: reused, not retrained
    assert (folder / "teacher_0.pt").stat().st_mtime_ns == stamp
    other = smopd_config(tmp_path, **{"train.teacher_dir": str(folder), "train.teacher_steps": 2})
    with pytest.raises(ValueError, match="holds teachers made with other settings"):
        build_trainer(other)


def test_bad_settings_fail_before_any_teacher_trains(tmp_path):
    for overrides, message in [
        ({"train.teachers": [{"priority": ["nope"]}]}, "unknown: nope"),
        ({"train.teachers": [{"priority": ["redness.RednessReward"], "mix": 0.4}]}, "sum to 1"),
        ({"train.teacher_steps": 0}, "teacher_steps=0"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_trainer(smopd_config(tmp_path, **overrides))
        assert not (tmp_path / "runs" / "toy" / "teachers" / "manifest.json").exists()
