"""OCR reward: 1 - normalized edit distance between the text quoted in the prompt and the text read from the
image. A prompt with no quoted text is not applicable (NaN).

Readers (`backend`, rewards/_ocr_backends.py): "rapidocr" (default; PP-OCRv6 ONNX models shipped inside the
rapidocr wheel, onnxruntime on the CPU, nothing to download and no system package) or "tesseract" (the Debian
binary through pytesseract).

Both strings are compared lowercased with whitespace removed; the distance is divided by the longer length,
so the score is in [0, 1].
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._ocr_backends import REQUIRES, build_reader

QUOTED = re.compile(r"\"([^\"]+)\"|“([^”]+)”")


def quoted_text(prompt: str) -> str | None:
    """The text between double quotes ("..." or “...”), several spans joined by a space; None if none."""
    spans = [a or b for a, b in QUOTED.findall(prompt)]
    return " ".join(spans) if spans else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute each cost 1), by the two-row dynamic programme."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _canonical(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def text_similarity(target: str, read: str) -> float:
    """1 - edit_distance / max(len) on canonical strings; 1.0 for an exact read, 0.0 for nothing in common."""
    target, read = _canonical(target), _canonical(read)
    longest = max(len(target), len(read))
    return 1.0 if longest == 0 else 1.0 - edit_distance(target, read) / longest


@REWARDS.register("ocr")
class OCRReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = REQUIRES["rapidocr"]  # the default backend's; an instance holds its own backend's

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str = "rapidocr",
        tesseract_config: str = "--psm 6",
        min_height: int = 64,
    ):
        # rapidocr runs onnxruntime on as many threads as torch has (one per process under `make test`)
        self._reader = build_reader(backend, num_threads=torch.get_num_threads(), tesseract_config=tesseract_config)
        self.backend, self.extra_requires = backend, REQUIRES[backend]
        self.device, self.min_height = torch.device(device), int(min_height)

    def read(self, image: torch.Tensor) -> str:
        """Text in one [3, H, W] image; small images are upscaled so the reader sees glyphs tall enough."""
        from PIL import Image

        from flowrl.media import to_uint8

        pil = Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy())
        if pil.height < self.min_height:
            scale = math.ceil(self.min_height / pil.height)
            pil = pil.resize((pil.width * scale, pil.height * scale), Image.BICUBIC)
        return self._reader(pil)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        scores = []
        for image, prompt in zip(images, prompts):
            target = quoted_text(prompt)
            scores.append(float("nan") if target is None else text_similarity(target, self.read(image)))
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32, device=self.device))  # [N]
