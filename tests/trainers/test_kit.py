"""The kit's stage-6 loop (flowrl.trainers.kit.OptimizerSteps) on a real OptimizerStep and EMA: which rows each
minibatch holds, where optimizer steps fall, what each step receives, and that accumulated backward calls give the
gradient of their sum (computed apart with autograd)."""

from types import SimpleNamespace

import torch
from accelerate import Accelerator

import flowrl.trainers.kit as kit
from flowrl.training.loop import RecipeConfig
from flowrl.training.optim import EMA, OptimizerStep


def setup(num_minibatches: int, accumulation: int):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    train = RecipeConfig(
        num_minibatches=num_minibatches, gradient_accumulation_steps=accumulation, max_grad_norm=1e9, learning_rate=1e-2
    )
    opt = OptimizerStep(Accelerator(cpu=True), net, train, micro_batch=2)
    ema = EMA(opt.names, opt.params, decay=0.5, every_n_steps=1)
    parts = SimpleNamespace(opt=opt, ema=ema, accelerator=opt.acc, cfg=SimpleNamespace(train=train), reward_grads=None)
    return net, opt, ema, parts


def test_minibatches_cover_each_epoch_and_steps_close_every_accumulation_window():
    net, opt, ema, parts = setup(num_minibatches=4, accumulation=2)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    orders = [torch.randperm(8, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    received, steps = [], kit.OptimizerSteps(parts)
    step = opt.step
    opt.step = lambda losses: received.append(losses.clone()) or step(losses)
    seen = []
    for mb in steps(orders):
        seen.append((mb.epoch, mb.rows.tolist(), mb.closes_step))
        loss = net(x[mb.index]).pow(2).mean()
        opt.backward(loss / 2, boundary=mb.closes_step)
        steps.losses.append(loss.detach())
    assert [s[2] for s in seen] == [False, True, False, True] * 2
    for epoch, order in enumerate(orders):  # each epoch's minibatches are its permutation in 4 consecutive pieces
        rows = [r for e, r, _ in seen if e == epoch]
        assert rows == [order[i : i + 2].tolist() for i in range(0, 8, 2)]
    assert opt.optimizer_steps == 4 and ema.num_updates == 4
    assert len(received) == 4 and all(
        torch.equal(r, torch.stack(steps.losses[2 * i : 2 * i + 2])) for i, r in enumerate(received)
    )


def test_an_accumulated_window_steps_on_the_gradient_of_its_summed_losses():
    net, opt, _, parts = setup(num_minibatches=2, accumulation=2)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    order = torch.tensor([3, 0, 2, 1])
    expected = torch.autograd.grad(
        sum(net(x[order[i : i + 2]]).pow(2).mean() / 2 for i in (0, 2)), list(net.parameters())
    )
    captured = {}
    step = opt.step

    def capture(losses):
        captured.update({name: p.grad.clone() for name, p in zip(opt.names, opt.params)})
        return step(losses)

    opt.step, steps = capture, kit.OptimizerSteps(parts)
    for mb in steps([order]):
        loss = net(x[mb.index]).pow(2).mean()
        opt.backward(loss / 2, boundary=mb.closes_step)
        steps.losses.append(loss.detach())
    assert opt.optimizer_steps == 1
    for (name, _), want in zip(net.named_parameters(), expected):
        torch.testing.assert_close(captured[name], want)
