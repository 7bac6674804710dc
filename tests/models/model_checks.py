"""Checks every adapter's tests share: a rollout's stored log-probs rescore exactly, and gradient checkpointing
leaves the LoRA gradients as they are."""

import torch

from flowrl import sde


def assert_log_probs_rescore_exactly(model, r) -> None:
    """Every stochastic transition of rollout `r`: the velocity of `model` at the stored latents, through
    `sde.rescore_transition`, gives the stored log-prob bit for bit (the on-policy ratio is exactly 1)."""
    assert len(r.transitions) > 0
    n = r.latents.shape[0]
    for k in sorted(set(r.transitions[:, 1].tolist())):
        x, x_next = r.latents[:, k], r.latents[:, k + 1]
        with torch.no_grad():
            v = model.velocity(x, r.sigmas[k], r.cond, r.guidance_scale)
            log_prob, _ = sde.rescore_transition(
                r.rule, v, x, x_next, r.sigmas[k].expand(n), r.sigmas[k + 1].expand(n), r.noise_levels[:, k]
            )
        for i in r.transitions[r.transitions[:, 1] == k, 0].tolist():
            assert log_prob[i].item() == r.log_probs[i, k].item(), (i, k)


def assert_checkpointing_keeps_lora_gradients(model, x: torch.Tensor, cond) -> None:
    """The gradients of a LoRA `model` (adapters added) for one velocity loss at `x`, [2, ...], are the same with
    gradient checkpointing on as off."""

    def grads():
        model.transformer.zero_grad()
        model.velocity(x, torch.tensor([0.7, 0.4]), cond, 3.0).square().mean().backward()
        # (Qwen-Image's last block still updates the text stream, which nothing reads: its to_add_out gets no gradient)
        return {
            n: p.grad.clone() for n, p in model.transformer.named_parameters() if p.requires_grad and p.grad is not None
        }

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.transformer.is_gradient_checkpointing
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)
