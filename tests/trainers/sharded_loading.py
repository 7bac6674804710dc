"""scripts/train.py that records, in each process, how the policy reached its device (test_sharded_loading.py): every
`Module.to(device)` of the transformer or a text encoder (whether FSDP2 had sharded it then), every `fully_shard` of
the transformer, and after training where their weights live; written to FOLDER/placement_<rank>.json.

    accelerate launch --config_file configs/accelerate/fsdp.yaml tests/trainers/sharded_loading.py CONFIG FOLDER
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed import fsdp

import flowrl.trainers.kit as kit


def watched(module) -> str | None:
    from diffusers.models.modeling_utils import ModelMixin
    from transformers import PreTrainedModel

    if isinstance(module, ModelMixin) and type(module).__name__.removeprefix("FSDP").endswith("Transformer2DModel"):
        return "transformer"
    if isinstance(module, PreTrainedModel):
        return "text_encoder"
    return None


def record(events: list) -> None:
    """Patch Module.to and fsdp.fully_shard (accelerate imports it at call time) to append events."""
    to, fully_shard = torch.nn.Module.to, fsdp.fully_shard

    def recording_to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and (name := watched(self)):
            events.append(
                {"event": "to", "module": name, "device": str(device), "sharded": isinstance(self, fsdp.FSDPModule)}
            )
        return to(self, *args, **kwargs)

    def recording_shard(module, *args, **kwargs):
        if not isinstance(module, list) and watched(module) == "transformer":
            events.append({"event": "shard", "module": "transformer"})
        return fully_shard(module, *args, **kwargs)

    torch.nn.Module.to, fsdp.fully_shard = recording_to, recording_shard


def placement(model) -> dict:
    """Where the trained transformer and the text encoder live now: local bytes vs whole bytes, devices."""
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.transformer.parameters())
    whole = sum(p.numel() for p in model.transformer.parameters())
    encoder = model.pipe.text_encoder
    return {
        "transformer_local": local,
        "transformer_whole": whole,
        "transformer_sharded": isinstance(model.transformer, fsdp.FSDPModule),
        "text_encoder_devices": sorted({str(p.device) for p in encoder.parameters()}),
        "offloaded": [type(m).__name__ for m in model.offloaded],
    }


if __name__ == "__main__":
    from flowrl.trainers import build_trainer, load_config

    config, folder = sys.argv[1], Path(sys.argv[2])
    events: list = []
    record(events)
    trainer = build_trainer(load_config(config, []))
    kit.train(trainer)
    out = {"events": events, "device": str(trainer.parts.accelerator.device), **placement(trainer.parts.model)}
    (folder / f"placement_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(out))
