"""Preview throughput on a GPU: an SD3.5-Medium-sized transformer with random weights, one denoiser forward per
call, at bf16 and at every preview precision this GPU runs (fp8 through torchao on sm_89+, nvfp4 on sm_100+; the
exact fake-quant emulations for reference). Writes JSON with forwards per second and the ratio to bf16.

    python scripts/bench_preview_gpu.py --json runs/bench/preview_gpu.json [--batch 8] [--size 1024]

Not run by the tests (it needs a CUDA GPU); the preview copies are the ones the candidates sampler builds
(flowrl.quant.build_preview), so the numbers are those of a Sol-RL exploration step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _gpu_archs import SD35_MEDIUM  # the published SD3.5-Medium transformer config, kept as data


def forwards_per_second(module, inputs, repeats: int) -> float:
    with torch.no_grad():
        module(**inputs)  # warm-up (kernel selection, lazy init)
        torch.cuda.synchronize()
        tic = time.perf_counter()
        for _ in range(repeats):
            module(**inputs)
        torch.cuda.synchronize()
    return repeats / (time.perf_counter() - tic)


def main() -> None:
    from diffusers import SD3Transformer2DModel

    from flowrl.quant import PreviewSpec, build_preview

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (latents are size / 8)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench_preview_gpu.py needs a CUDA GPU; this machine has none")
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**SD35_MEDIUM).to(device, torch.bfloat16).eval()
    side = args.size // 8
    inputs = dict(
        hidden_states=torch.randn(args.batch, 16, side, side, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(args.batch, 333, 4096, device=device, dtype=torch.bfloat16),
        pooled_projections=torch.randn(args.batch, 2048, device=device, dtype=torch.bfloat16),
        timestep=torch.full((args.batch,), 500.0, device=device),
        return_dict=False,
    )
    capability = torch.cuda.get_device_capability(device)
    result = {"device": torch.cuda.get_device_name(device), "capability": f"sm_{capability[0]}{capability[1]}"}
    result["batch"], result["size"] = args.batch, args.size
    base = forwards_per_second(model, inputs, args.repeats)
    result["bf16"] = {"forwards_per_s": base, "ratio_to_bf16": 1.0}
    for backend in ("fp8", "nvfp4", "fake_fp8", "fake_nvfp4"):
        try:
            preview = build_preview(model, PreviewSpec([backend]), "sd3")
            speed = forwards_per_second(preview, inputs, args.repeats)
            result[backend] = {"forwards_per_s": speed, "ratio_to_bf16": speed / base}
            del preview
        except (ValueError, ImportError, RuntimeError) as err:
            result[backend] = {"error": str(err).splitlines()[0]}
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
