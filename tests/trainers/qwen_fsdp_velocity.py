r"""Qwen-Image velocities with the transformer sharded by FSDP2 over the launched processes (test_qwen_image_fsdp.py):
each process encodes its own prompts (PROMPTS[rank]: their padded lengths differ between the processes), counts the
transformer's calls and writes its velocities (guidance 1 and 4) to FOLDER/velocity_<rank>.pt.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \
        tests/trainers/qwen_fsdp_velocity.py PIPELINE FOLDER
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

# rank 0: two prompts of one padded length; rank 1: a prompt of that length and a longer one (two lengths)
PROMPTS = [["a red cat", "two blue dogs on a hill"], ["a red cat", "a red cat on a mat " * 6]]


def inputs(model, rank: int):
    """Noisy latents [2, L, 4C] and σ [2], the same on every process and in the single-process reference."""
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(rank))
    return x, torch.tensor([0.7, 0.4])


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flowrl.models import load_flow_model

    torch.set_num_threads(1)
    pipeline, folder = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatched collective fails in a minute
    rank = dist.get_rank()
    model = load_flow_model(pipeline)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.transformer_blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.transformer, mesh=mesh)
    calls = []
    model.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    x, sigma = inputs(model, rank)
    cond = model.encode(PROMPTS[rank], guidance_scale=4.0)
    with torch.no_grad():
        out = {"plain": model.velocity(x, sigma, cond, 1.0), "guided": model.velocity(x, sigma, cond, 4.0)}
    torch.save({**out, "calls": len(calls)}, folder / f"velocity_{os.environ['RANK']}.pt")
    dist.barrier()
    dist.destroy_process_group()
