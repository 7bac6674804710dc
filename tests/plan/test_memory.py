"""flowrl.plan.activations and flowrl.plan.memory: activation counts against hand counts, the estimate of one
training micro-batch against its measured CPU peak (toy model and tiny SD3 transformer, LoRA and full fine-tuning, with
and without gradient checkpointing), the sharding arithmetic and the suggestions by hand."""

from __future__ import annotations

import types

import pytest
import torch

from flowrl.plan import activations as A
from flowrl.plan import memory as M

MIB = 2**20
TOLERANCE = 0.25  # the estimate of a micro-batch is within 25% of its measured peak


# ------------------------------------------------------------------------------------------ (a) hand counts


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_activation_bytes_of_a_two_layer_mlp_is_the_hand_count():
    rows = 4
    # the first Linear saves its input (for its weight gradient), ReLU its output, which the second Linear saves again
    # (the same storage: counted once); the weights autograd saves for the input gradients are not activations
    assert A.activation_bytes(_mlp(), lambda r: torch.randn(r, 16), rows=rows) == rows * 16 * 4 + rows * 32 * 4
    frozen_first = _mlp()
    frozen_first[0].requires_grad_(False)  # nothing before the second Linear trains: only its input is saved
    assert A.activation_bytes(frozen_first, lambda r: torch.randn(r, 16), rows=rows) == rows * 32 * 4
    with torch.device("meta"):  # the same count without memory
        meta = _mlp()
        assert A.activation_bytes(meta, lambda r: torch.randn(r, 16), rows=rows) == rows * 16 * 4 + rows * 32 * 4


class _Blocks(torch.nn.Module):
    """Three Linear-ReLU-Linear blocks of width 8, checkpointable through diffusers' interface."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)) for _ in range(3)
        )
        self.gradient_checkpointing = False

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None):
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = gradient_checkpointing_func

    def forward(self, x):
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = self._gradient_checkpointing_func(block, x)
            else:
                x = block(x)
        return x


def test_checkpointing_counts_block_inputs_plus_the_largest_block():
    rows, act = 5, 5 * 8 * 4  # one [rows, 8] float32 activation
    module = _Blocks()
    # each block saves its input and its ReLU output
    assert A.activation_bytes(module, lambda r: torch.randn(r, 8), rows=rows) == 3 * 2 * act
    count = A.count_activations(module, lambda r: torch.randn(r, 8), rows=rows, checkpointing=True, working=True)
    # the checkpoint keeps the three block inputs; one block at a time recomputes its ReLU output
    assert (count.kept, count.blocks, count.total) == (3 * act, [act, act, act], 4 * act)
    assert count.working >= count.total - act  # the tracked forward + backward holds about what was counted
    assert not module.gradient_checkpointing  # the module is left as it was given


def test_measure_peak_tracks_frees_and_views():
    weight = torch.nn.Linear(10, 10)  # 440 bytes of parameters, alive before

    def fn():
        a = torch.empty(1000)  # 4000
        b = torch.empty(500)  # 2000: 6000 live
        del a
        c = torch.empty(2000)  # b + c: 10000 live
        view = c[10:]  # the same storage: nothing new
        return b, view

    assert A.measure_peak(fn, alive=[weight]) == 440 + 10000


# ------------------------------------------------------------------------------------------ (b) estimate vs measured

ONE_PROCESS = types.SimpleNamespace(num_processes=1, distributed_type=types.SimpleNamespace(name="NO"))


def _toy(rows):
    """The shipped toy model, its meta twin, the inputs of one micro-batch and the frozen parts it keeps resident."""
    from flowrl.models.toy import build_unet, load_toy_model

    model = load_toy_model()
    with torch.device("meta"):
        twin = build_unet()
    cond = model.encode(["three red circles"] * rows)

    def meta_inputs(r):
        with torch.device("meta"):
            return dict(
                sample=torch.empty(r, 12, 16, 16), timestep=torch.empty(r), encoder_hidden_states=torch.empty(r, 5, 64)
            )

    return model, twin, cond, meta_inputs, {"text_encoder": model.text_encoder}


def _sd3(rows, folder):
    """The tiny SD3 pipeline's transformer (flowrl.models.tiny), its meta twin, inputs and resident frozen parts."""
    from diffusers import SD3Transformer2DModel

    from flowrl.models import load_flow_model

    model = load_flow_model(folder)
    with torch.device("meta"):
        twin = SD3Transformer2DModel.from_config(model.transformer.config)
    one = model.encode(["a red circle"], guidance_scale=1.0)
    cond = {k: v.expand(rows, *v.shape[1:]).clone() for k, v in one.items()}
    length, width = cond["prompt_embeds"].shape[1:]

    def meta_inputs(r):
        with torch.device("meta"):
            return dict(
                hidden_states=torch.empty(r, 4, 16, 16),
                timestep=torch.empty(r),
                encoder_hidden_states=torch.empty(r, length, width),
                pooled_projections=torch.empty(r, cond["pooled_prompt_embeds"].shape[1]),
            )

    pipe = model.pipe
    frozen = {n: getattr(pipe, n) for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")}
    return model, twin, cond, meta_inputs, frozen


CASES = [(family, lora, ckpt) for family in ("toy", "sd3") for lora in (True, False) for ckpt in (False, True)]


@pytest.fixture(scope="module")
def sd3_folder(tiny_pipeline):
    return tiny_pipeline("sd3")


@pytest.mark.parametrize(
    ("family", "lora", "ckpt"),
    CASES,
    ids=[f"{f}-{'lora' if lo else 'full'}{'-ckpt' if c else ''}" for f, lo, c in CASES],
)
def test_estimate_of_one_micro_batch_is_within_25_percent_of_its_measured_peak(
    family, lora, ckpt, sd3_folder, one_torch_thread
):
    """One micro-batch as a recipe runs it (velocity with grad, a loss, OptimizerStep's backward and AdamW step) in the
    steady state (AdamW's moments exist), measured on the CPU; estimated from parameter counts and the activations
    counted on a meta twin of the transformer."""
    from flowrl.training.optim import OptimizerConfig, OptimizerStep

    torch.manual_seed(0)
    rows = 16 if family == "toy" else 8
    model, twin, cond, meta_inputs, frozen = _toy(rows) if family == "toy" else _sd3(rows, sd3_folder)
    if lora:  # as configs/toy/grpo.yaml: rank 16, alpha 16 on the family's LoRA targets
        model.add_lora(rank=16, alpha=16)
        A.with_lora(twin, 16, model.lora_target_modules, alpha=16)
    else:
        model.transformer.requires_grad_(True)
        twin.requires_grad_(True)
    if ckpt:
        model.enable_gradient_checkpointing()
    x = torch.randn(rows, *model.latent_shape(32, 32))
    sigma, target = torch.rand(rows), torch.randn_like(x)
    opt = OptimizerStep(ONE_PROCESS, model.transformer, OptimizerConfig(), micro_batch=rows)

    def micro_batch():
        v = model.velocity(x, sigma, cond, 1.0)
        loss = (v - target).pow(2).mean()
        opt.backward(loss, boundary=True)
        opt.step(loss.detach()[None])

    micro_batch()  # the optimizer's state exists from the first step on
    measured = A.measure_peak(micro_batch, alive=[model.transformer, opt.optimizer, x, sigma, cond, target, frozen])

    count = A.count_activations(twin, meta_inputs, rows=rows, checkpointing=ckpt, working=True)
    transformer = model.transformer
    trained = A.param_count(transformer, trainable=True)
    plan = M.MemoryPlan(
        params=A.param_count(transformer, trainable=False) if lora else trained,
        activation_row_bytes={(lora, ckpt): count.total / rows},
        transient_bytes={(lora, ckpt): count.transient},
        rows=rows,
        use_lora=lora,
        lora_params=trained if lora else 0,
        checkpointing=ckpt,
        weight_dtype="float32",
        mixed_precision="fp32",
        buffer_bytes=A.storage_bytes(list(transformer.buffers())),
        frozen=tuple(M.Frozen(name, A.param_count(m), "float32") for name, m in frozen.items()),
        gpu=False,
    )
    parts = M.estimate_peak(plan)
    estimated = parts["total"] * M.GIB
    print(f"{family} lora={lora} ckpt={ckpt}: estimated {estimated / MIB:.2f} MiB, measured {measured / MIB:.2f} MiB")
    assert abs(estimated / measured - 1) <= TOLERANCE, (parts, measured / M.GIB)
    if family == "sd3" and lora:  # the meta twin counts what the real module keeps

        def inputs(r):
            from flowrl.sde import timesteps_from_sigmas

            return dict(
                hidden_states=x[:r],
                timestep=timesteps_from_sigmas(sigma[:r]),
                encoder_hidden_states=cond["prompt_embeds"][:r],
                pooled_projections=cond["pooled_prompt_embeds"][:r],
            )

        assert A.activation_bytes(transformer, inputs, rows=rows, checkpointing=ckpt) == count.total


# ------------------------------------------------------------------------------------------ (c) sharding by hand

G = 2**30  # parameters in round numbers, so that GiB come out exact


def _plan(**changes) -> M.MemoryPlan:
    base = dict(
        params=2 * G,  # 2 Gi parameters
        lora_params=G // 8,
        activation_row_bytes={(True, False): 4 * G, (True, True): G, (False, False): 5 * G, (False, True): 2 * G},
        transient_bytes={(True, False): G // 2},
        rows=2,
        weight_dtype="bfloat16",
        use_ema=True,
        frozen=(M.Frozen("text_encoder", 3 * G, offloadable=True), M.Frozen("vae", G // 2, offloaded=True)),
        num_gpus=8,
        overhead_gib=3.0,
    )
    return M.MemoryPlan(**{**base, **changes})


def test_lora_sharding_by_hand():
    # LoRA, 2 Gi bf16 base weights = 4 GiB; 1/8 Gi trained: fp32 param 0.5, grad 0.5, AdamW 1.0, EMA 0.5 GiB
    lora = dict(
        weights=4.0, trainable=0.5, gradients=0.5, optimizer=1.0, ema=0.5, activations=8.0, transient=0.5, frozen=6.0
    )
    assert _parts(_plan(sharding="none")) == {**lora, "overhead": 3.0, "total": 24.0}
    # FSDP2 over 8: weights, trainable, gradients, optimizer and EMA / 8; activations, frozen whole
    fsdp = dict(weights=0.5, trainable=0.5 / 8, gradients=0.5 / 8, optimizer=1.0 / 8, ema=0.5 / 8)
    assert _parts(_plan(sharding="fsdp")) == {**lora, **fsdp, "overhead": 3.0, "total": 18.0 + 2.5 / 8}
    # ZeRO-2: gradients and optimizer / 8, weights (and the EMA copy) whole
    zero2 = dict(gradients=0.5 / 8, optimizer=1.0 / 8)
    assert _parts(_plan(sharding="zero2")) == {**lora, **zero2, "overhead": 3.0, "total": 24.0 - 1.5 + 1.5 / 8}
    # FSDP2 gathers the largest block whole, prefetching the next: 2 x 1/4 Gi params x 2 bytes (bf16 compute)
    assert M.estimate_peak(_plan(sharding="fsdp", largest_block_params=G // 4))["weights"] == 0.5 + 1.0
    assert M.estimate_peak(_plan(sharding="fsdp", gpu=False))["overhead"] == 0.0


def test_full_fine_tuning_by_hand():
    # full: 2 Gi trained fp32 parameters (8 GiB), gradients 8, AdamW 16, EMA 8; the frozen reference copy is fp32, whole
    full = _plan(use_lora=False, reference_copy=True, use_ema=False, checkpointing=True)
    parts = _parts(full)
    assert (parts["weights"], parts["trainable"], parts["gradients"], parts["optimizer"], parts["ema"]) == (
        8.0,
        8.0,
        8.0,
        16.0,
        0.0,
    )
    assert (parts["activations"], parts["transient"], parts["total"]) == (4.0, 0.0, 8 + 8 + 8 + 16 + 4 + 6 + 3)
    sharded = _parts(_plan(use_lora=False, reference_copy=True, use_ema=False, checkpointing=True, sharding="fsdp"))
    assert (sharded["weights"], sharded["trainable"], sharded["gradients"], sharded["optimizer"]) == (
        8.0,
        1.0,
        1.0,
        2.0,
    )
    # DeepSpeed's fp16 engine: fp16 parameters whole, the fp32 partition of the gradients beside the fp16 one, fp32
    # masters
    fp16 = _parts(_plan(use_lora=False, use_ema=False, sharding="zero2", mixed_precision="fp16"))
    assert (fp16["trainable"], fp16["gradients"], fp16["optimizer"]) == (4.0, 2 * 6 / 8, 2 * 12 / 8)


def _parts(plan: M.MemoryPlan) -> dict[str, float]:
    parts = M.estimate_peak(plan)
    assert parts.pop("trainable_params") == plan.trainable_params
    return parts


def test_suggestions_are_computed():
    plan = _plan(rows=4)  # LoRA, no checkpointing: 4 + 0.5 + 0.5 + 1 + 0.5 + 16 + 0.5 + 6 + 3 = 32 GiB
    assert M.estimate_peak(plan)["total"] == 32.0 and M.fits(32.0, 32) and not M.fits(32.0, 31.9)
    assert M.suggestion(plan, 40) == ""
    text = M.suggestion(plan, 24)
    # checkpointing: activations 16 -> 4, no transient counted for it (19.5 GiB); offloading the text encoder: 26
    # (not enough, not named); 2 rows: 24 GiB, the largest micro-batch that fits; FSDP2 leaves 16 + 0.5 + 6 + 3 GiB
    assert "use_gradient_checkpointing: true) (19.5 GiB)" in text
    assert "2 rows instead of 4 (train.num_minibatches x 2) (24.0 GiB)" in text
    assert "offload" not in text and "FSDP2" not in text
    # sharding: the smallest FSDP2 that fits
    big = _plan(params=40 * G, rows=1)  # 80 GiB of bf16 weights alone
    text = M.suggestion(big, 40)
    fsdp = [n for n in (2, 4, 8, 16) if f"FSDP2 over {n} GPUs" in text]
    assert fsdp == [4]
    assert (
        M.estimate_peak(big, sharding="fsdp", num_gpus=2)["total"]
        > 40
        >= M.estimate_peak(big, sharding="fsdp", num_gpus=4)["total"]
    )
    # nothing alone fits: checkpointing (95.5), offloading (89.5), then FSDP2 over 8 (10 + 2.5 / 8 + 4 + 3) at 4 rows
    combined = M.suggestion(_plan(params=40 * G, rows=4), 20)
    steps = "enable gradient checkpointing (model.use_gradient_checkpointing: true); offload the text encoders"
    assert f"together these do: {steps}" in combined and combined.endswith(
        "then shard with FSDP2 over 8 GPUs (configs/accelerate/fsdp.yaml) (17.3 GiB)"
    )


def test_plan_checks_its_inputs():
    with pytest.raises(ValueError, match="sharding"):
        _plan(sharding="zero3")
    with pytest.raises(ValueError, match="no count for use_lora=True, checkpointing=True"):
        _plan(activation_row_bytes={(True, False): 1}, checkpointing=True)
    with pytest.raises(ValueError, match="lora_params"):
        _plan(lora_params=0)
