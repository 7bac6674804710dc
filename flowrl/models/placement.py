"""Where a loaded pipeline's parts live when its transformer is about to be sharded by FSDP2
(docs/models.md#loading-under-fsdp2).

Every process loads the whole pipeline. Moved to the GPU before `fully_shard`, it would hold the whole transformer and
the text encoders on every GPU at once (FLUX.2 [dev]: a 32B transformer and a 24B Mistral, about 104 GiB in bf16),
so a loader asked for a sharded policy (`load_flow_model(..., sharded=True)`) places instead:

- the trained transformer on the CPU: `fully_shard` (flowrl.training.distributed.Sharding.prepare) moves it to the GPU
  one shard unit (transformer block) at a time and keeps only this process's shard of each;
- the text encoders (components named `text_encoder*`) on the CPU: `encode` copies them to the GPU for a call that
  has prompts to encode and drops the copy after (`on_device`); the prompt cache keeps every encoded prompt, so a
  prompt costs one such call per run;
- every other module (VAE, a frozen second expert, image encoders) on the GPU, as an unsharded run does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

OFFLOADED_PREFIX = "text_encoder"  # diffusers' names: text_encoder, text_encoder_2, text_encoder_3


def place_for_sharding(model, device: str | torch.device) -> None:
    """Place a freshly built adapter's pipeline for FSDP2 (see the module docstring): `model.transformer` stays where
    it was loaded (the CPU), text encoders stay there too and are listed in `model.offloaded`, the rest moves to
    `device`."""
    offloaded = []
    for name, component in model.pipe.components.items():
        if not isinstance(component, torch.nn.Module) or component is model.transformer:
            continue
        if name.startswith(OFFLOADED_PREFIX):
            offloaded.append(component)
        else:
            component.to(device)
    model.offloaded = tuple(offloaded)


def offload_text_encoders(model) -> None:
    """`model.offload_text_encoders: true`: move the text encoders (components named `text_encoder*`) to the CPU and
    list them in `model.offloaded`, so that `encode` copies them to the model's device only for a call with prompts
    the prompt cache lacks (docs/models.md#prompt-cache)."""
    encoders = [
        c for n, c in model.pipe.components.items() if n.startswith(OFFLOADED_PREFIX) and isinstance(c, torch.nn.Module)
    ]
    if not encoders:
        raise ValueError(
            f"model.offload_text_encoders=true: the {model.family} pipeline has no text encoders; leave it false"
        )
    for encoder in encoders:
        encoder.to("cpu")
    model.offloaded = tuple(dict.fromkeys([*model.offloaded, *encoders]))


@contextlib.contextmanager
def on_device(modules: Sequence[torch.nn.Module], device: str | torch.device) -> Iterator[None]:
    """The modules' parameters and buffers on `device` inside the block; on exit every module holds its own tensors
    again (nothing is copied back, the device copies are dropped). A tensor shared by two places (tied weights) is
    copied once; one already on `device` is not copied."""
    copies: dict[int, torch.Tensor] = {}
    swapped = []  # (the module's parameter or buffer dict, name, its own tensor)
    with torch.no_grad():
        for module in modules:
            for sub in module.modules():
                for store in (sub._parameters, sub._buffers):
                    for name, tensor in store.items():
                        if tensor is None:
                            continue
                        if id(tensor) not in copies:
                            moved = tensor.detach().to(device)
                            is_parameter = isinstance(tensor, torch.nn.Parameter)
                            copies[id(tensor)] = (
                                torch.nn.Parameter(moved, tensor.requires_grad) if is_parameter else moved
                            )
                        swapped.append((store, name, tensor))
                        store[name] = copies[id(tensor)]
    try:
        yield
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor
