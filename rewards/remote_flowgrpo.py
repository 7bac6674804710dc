"""Client for flow_grpo-style reward servers (the GenEval and DeQA servers of flow_grpo's `reward-server`, and the
servers written to the same protocol), so that a user points flowrl at the servers they already run.

The protocol: POST `url` with body pickle.dumps({"images": [JPEG bytes per sample], "meta_datas": [a sample's
metadata with its "prompt"], **extra}); a 200 answer is a pickled dict whose `score_key` entry ("scores") holds one
number per sample (None = not applicable -> NaN); any other status carries the server's traceback as text.

Unpickling an answer can run code chosen by whoever controls the server or the network path to it. This reward
therefore refuses to start unless `unsafe_unpickle: true` says that you trust the server, and even then it reads
answers with an unpickler that resolves no global except numpy's array and scalar constructors (what such servers
return), so a crafted answer fails instead of running. Use `remote` (flowrl serve-reward: safetensors and JSON, no
pickle) for servers you control.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from PIL import Image

from flowrl.media import to_uint8
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._http import HTTPStatusError, NoAnswer, exchange

# the only globals an answer may name: numpy's reconstruction of arrays and scalars (both numpy 1.x and 2.x paths)
ALLOWED_GLOBALS = {
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
}


class _AnswerUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"the answer names {module}.{name}, which a reward answer has no use for")
        return super().find_class(module, name)


def read_answer(data: bytes) -> Any:
    """A server's pickled answer, with no global but numpy's array and scalar constructors resolved."""
    return _AnswerUnpickler(io.BytesIO(data)).load()


def encode_jpegs(images: torch.Tensor, quality: int) -> list[bytes]:
    """[N, 3, H, W] in [0, 1] -> N JPEG byte strings (8-bit, as the protocol's clients send them)."""
    out = []
    for array in to_uint8(images).permute(0, 2, 3, 1).contiguous().cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        out.append(buffer.getvalue())
    return out


@REWARDS.register("remote_flowgrpo")
class RemoteFlowGRPOReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        url: str = "",
        unsafe_unpickle: bool = False,
        score_key: str = "scores",
        extra: dict[str, Any] | None = None,
        jpeg_quality: int = 95,
        timeout_s: float = 120.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"remote_flowgrpo url={url!r} must be the server's http(s) URL, e.g. http://127.0.0.1:18085"
            )
        if unsafe_unpickle is not True:
            raise ValueError(
                "remote_flowgrpo answers are pickles, which can run code of whoever controls the server: set "
                "unsafe_unpickle: true only for a server you trust (or serve the reward with flowrl serve-reward and "
                "use reward remote)"
            )
        if not 1 <= jpeg_quality <= 100:
            raise ValueError(
                f"remote_flowgrpo jpeg_quality={jpeg_quality} must be in [1, 100] (flow_grpo's clients: 95)"
            )
        self.url, self.score_key, self.extra = url, score_key, dict(extra or {})
        self.jpeg_quality, self.timeout_s = jpeg_quality, timeout_s

    def request_body(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> bytes:
        meta_datas = [{**meta, "prompt": prompt} for prompt, meta in zip(prompts, metadata)]
        return pickle.dumps({"images": encode_jpegs(images, self.jpeg_quality), "meta_datas": meta_datas, **self.extra})

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        where = f"remote_flowgrpo {self.url}"
        headers = {"Content-Type": "application/octet-stream"}
        try:
            data = exchange(self.url, self.request_body(images, prompts, metadata), headers, self.timeout_s)
        except HTTPStatusError as err:
            lines = [line for line in err.body.decode("utf-8", "replace").splitlines() if line.strip()]
            raise RuntimeError(f"{where}: HTTP {err.code}: {lines[-1] if lines else err.reason}") from None
        except NoAnswer as err:
            raise ConnectionError(f"{where}: no answer ({err.last}); is the server running?") from None
        try:
            answer = read_answer(data)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
            raise RuntimeError(f"{where}: the answer is not a readable pickle of plain values ({err})") from None
        scores = answer.get(self.score_key) if isinstance(answer, dict) else None
        if scores is None or len(scores) != len(prompts):
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise RuntimeError(
                f"{where}: the answer has no {len(prompts)} scores under {self.score_key!r} (it holds {keys}); "
                "set score_key"
            )
        values = [float("nan") if s is None else float(s) for s in scores]
        return RewardOutput(scores=torch.tensor(values, dtype=torch.float32))
