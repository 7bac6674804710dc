r"""scripts/train.py that records, in each process after training, the dtypes of the state that must stay float32 under
a sharded preset (test_sharded_precision.py): the trained parameters, their EMA, NFT's old adapter, and the
MixedPrecisionPolicy every `fully_shard` got; written to FOLDER/precision_<rank>.json.

    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml \
        tests/trainers/precision_probe.py CONFIG FOLDER
"""

import json
import os
import sys
from pathlib import Path

from torch.distributed import fsdp

import flowrl.trainers.kit as kit


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype) for t in tensors})


if __name__ == "__main__":
    from flowrl.trainers import build_trainer, load_config

    config, folder = sys.argv[1], Path(sys.argv[2])
    policies: list = []
    fully_shard = fsdp.fully_shard

    def recording_shard(module, *args, **kwargs):
        policy = kwargs.get("mp_policy")
        policies.append([str(policy.param_dtype), str(policy.reduce_dtype)] if policy is not None else None)
        return fully_shard(module, *args, **kwargs)

    fsdp.fully_shard = recording_shard  # accelerate imports it at call time
    trainer = build_trainer(load_config(config, []))
    kit.train(trainer)
    out = {
        "trainable": dtypes(trainer.parts.opt.params),
        "ema": dtypes(trainer.parts.ema.shadow.values()),
        "old": dtypes(trainer.parts.adapters["old"].values()),
        "policies": policies,
    }
    (folder / f"precision_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(out))
