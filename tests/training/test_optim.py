"""flowrl.training.optim: the EMA recurrence written out by hand, the fp16 loss scaler, and the optimizer step's
non-finite policy on a real single-process `accelerate.Accelerator(cpu=True)` (no mocks)."""

import pytest
import torch
from accelerate import Accelerator

from flowrl.training.optim import EMA, LossScaler, OptimizerConfig, OptimizerStep

# ---- EMA -------------------------------------------------------------------------------------------------------


def run_ema(mode, decay, every_n_steps, num_steps=8):
    """p_s = s after optimizer step s (p_0 = 0 when the EMA is built); returns (ema, the steps that updated)."""
    p = torch.tensor(0.0, dtype=torch.float64)
    ema = EMA(["p"], [p], decay, every_n_steps, mode)
    updated = []
    for s in range(1, num_steps + 1):
        p.fill_(float(s))
        if ema.update([p], s):
            updated.append(s)
    return ema, updated


def test_ramp_ema_follows_the_hand_recurrence_with_s_the_optimizer_steps():
    ema, updated = run_ema("ramp", 0.9, every_n_steps=2)
    assert updated == [2, 4, 6, 8] and ema.num_updates == 4
    shadow = 0.0
    for s in (2, 4, 6, 8):
        d = min((1 + s) / (10 + s), 0.9)  # s counts optimizer steps, not EMA updates
        shadow = d * shadow + (1 - d) * s
    assert ema.shadow["p"].item() == pytest.approx(shadow, rel=1e-12, abs=0)
    # the same recurrence with the update count in place of s gives another number: the test can tell them apart
    wrong = 0.0
    for u, s in enumerate((2, 4, 6, 8), start=1):
        d = min((1 + u) / (10 + u), 0.9)
        wrong = d * wrong + (1 - d) * s
    assert abs(wrong - shadow) > 0.1


def test_ramp_decay_is_capped_by_the_configured_decay():
    ema = EMA(["p"], [torch.zeros(())], 0.9, 1, "ramp")
    assert ema.decay_at(2) == 3 / 12 and ema.decay_at(80) == 81 / 90 and ema.decay_at(1000) == 0.9


def test_constant_ema_uses_its_decay_from_the_first_update():
    ema, updated = run_ema("constant", 0.995, every_n_steps=2)
    assert updated == [2, 4, 6, 8]
    shadow = 0.0
    for s in (2, 4, 6, 8):
        shadow = 0.995 * shadow + (1 - 0.995) * s
    assert ema.shadow["p"].item() == pytest.approx(shadow, rel=1e-12, abs=0)


def test_swapped_puts_the_ema_in_and_restores_the_weights():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    ema = EMA(["w"], [w], 0.5, 1, "constant")
    with torch.no_grad():
        w.copy_(torch.tensor([3.0, 2.0, 1.0]))
    ema.update([w], 1)  # shadow = 0.5 * [1, -2, 3] + 0.5 * [3, 2, 1] = [2, 0, 2]
    assert torch.equal(ema.shadow["w"], torch.tensor([2.0, 0.0, 2.0]))
    with ema.swapped([w]):
        assert torch.equal(w.detach(), torch.tensor([2.0, 0.0, 2.0]))
    assert torch.equal(w.detach(), torch.tensor([3.0, 2.0, 1.0]))
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped([w]):
            raise RuntimeError("inside")
    assert torch.equal(w.detach(), torch.tensor([3.0, 2.0, 1.0]))  # restored on an error too
    assert torch.equal(ema.shadow["w"], torch.tensor([2.0, 0.0, 2.0]))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"mode": "linear"}, "ema_mode"),
        ({"every_n_steps": 0}, "ema_every_n_steps"),
        ({"decay": 1.5}, "ema_decay"),
    ],
)
def test_ema_bad_settings_name_the_field(kwargs, message):
    args = {"decay": 0.9, "every_n_steps": 1, "mode": "ramp", **kwargs}
    with pytest.raises(ValueError, match=message):
        EMA(["p"], [torch.zeros(())], args["decay"], args["every_n_steps"], args["mode"])


# ---- LossScaler ------------------------------------------------------------------------------------------------


def test_loss_scaler_halves_on_overflow_and_doubles_after_growth_interval_good_steps():
    scaler = LossScaler(True, init_scale=64.0, growth_interval=3)
    scaler.update(overflow=True)
    assert (scaler.scale, scaler.good_steps) == (32.0, 0)
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert (scaler.scale, scaler.good_steps) == (32.0, 2)
    scaler.update(overflow=True)  # an overflow resets the count of good steps
    assert (scaler.scale, scaler.good_steps) == (16.0, 0)
    for _ in range(3):
        scaler.update(overflow=False)
    assert (scaler.scale, scaler.good_steps) == (32.0, 0)


def test_loss_scaler_default_growth_is_after_2000_good_steps_and_the_scale_stays_at_least_one():
    scaler = LossScaler(True)
    assert scaler.scale == 2.0**16
    for _ in range(1999):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**16
    scaler.update(overflow=False)
    assert scaler.scale == 2.0**17
    for _ in range(40):
        scaler.update(overflow=True)
    assert scaler.scale == 1.0


def test_disabled_loss_scaler_is_one_and_never_moves():
    scaler = LossScaler(False, init_scale=64.0, growth_interval=1)
    for overflow in (True, False, False):
        scaler.update(overflow)
    assert (scaler.scale, scaler.good_steps) == (1.0, 0)


def test_loss_scaler_state_dict_round_trip():
    scaler = LossScaler(True, init_scale=64.0, growth_interval=3)
    for overflow in (True, False, False):
        scaler.update(overflow)
    state = scaler.state_dict()
    assert state == {"scale": 32.0, "good_steps": 2}
    other = LossScaler(True, init_scale=4.0, growth_interval=3)
    other.load_state_dict(state)
    assert other.state_dict() == state
    scaler.update(False)
    other.update(False)
    assert other.state_dict() == scaler.state_dict() == {"scale": 64.0, "good_steps": 0}


# ---- OptimizerStep ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def linear_step(accelerator, mixed_precision="fp32", **cfg):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    config = OptimizerConfig(**{"learning_rate": 0.1, "use_ema": False, **cfg})
    return module, OptimizerStep(accelerator, module, config, micro_batch=1, mixed_precision=mixed_precision)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def one_step(module, opt, factor=1.0):
    """Backward of `factor * sum(module(x))` and the optimizer step; returns whether the weights moved."""
    loss = module(torch.ones(1, 3)).sum() * factor
    opt.backward(loss, boundary=True)
    return opt.step(loss.detach()[None])


def test_a_nan_loss_skips_the_step_and_counts_it(accelerator):
    module, opt = linear_step(accelerator, max_consecutive_nan_steps=3)
    assert opt.sharding.kind is None and not opt.scaler.enabled
    before = weights(module)
    assert one_step(module, opt, float("nan")) is False
    assert all(torch.equal(a, b) for a, b in zip(before, weights(module)))
    assert opt.counters == {"skipped_nan_steps": 1, "skipped_overflow_steps": 0}
    assert opt.nan_streak == 1 and opt.optimizer_steps == 0
    assert all(p.grad is None for p in module.parameters())  # the bad gradient does not leak into the next step
    assert one_step(module, opt) is True  # a good step moves the weights and ends the streak
    assert opt.nan_streak == 0 and opt.optimizer_steps == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(module)))
    assert opt.metrics()["train/skipped_nan_steps"] == 1.0


def test_max_consecutive_nan_steps_raises_with_the_count(accelerator):
    module, opt = linear_step(accelerator, max_consecutive_nan_steps=3)
    assert one_step(module, opt, float("nan")) is False
    assert one_step(module, opt, float("nan")) is False
    with pytest.raises(FloatingPointError, match="^3 optimizer steps in a row had a non-finite loss or gradient"):
        one_step(module, opt, float("nan"))
    assert opt.counters["skipped_nan_steps"] == 3 and opt.optimizer_steps == 0


def test_fp16_overflow_lowers_the_scale_and_is_not_a_nan_step(accelerator):
    """A finite loss whose scaled gradient overflows (1e38 * scale > float32 max) skips the step as an overflow:
    the scale halves each time and the NaN streak stays 0, even past max_consecutive_nan_steps."""
    module, opt = linear_step(accelerator, "fp16", max_consecutive_nan_steps=2)
    assert opt.scaler.enabled and opt.scaler.scale == 2.0**16
    before = weights(module)
    for k in range(1, 5):
        assert one_step(module, opt, 1e38) is False
        assert opt.scaler.scale == 2.0 ** (16 - k)
        assert opt.counters == {"skipped_nan_steps": 0, "skipped_overflow_steps": k} and opt.nan_streak == 0
    assert all(torch.equal(a, b) for a, b in zip(before, weights(module)))
    assert opt.optimizer_steps == 0
    # a NaN loss under fp16 is still a NaN step (it counts toward the streak)
    assert one_step(module, opt, float("nan")) is False
    assert opt.counters["skipped_nan_steps"] == 1 and opt.nan_streak == 1
    # a good step trains with the unscaled gradient: one Adam step moves each weight by about lr
    assert one_step(module, opt) is True and opt.optimizer_steps == 1 and opt.nan_streak == 0
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(before, weights(module))])
    torch.testing.assert_close(moved, torch.full_like(moved, 0.1), rtol=1e-3, atol=0)
