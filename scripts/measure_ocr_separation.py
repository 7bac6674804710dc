"""How well the ocr reward separates the right text from a wrong one, per backend: 24 prompts with quoted text, each
rendered with PIL once with its own text and once with the next prompt's text; prints the mean score of each and
the seconds per image as JSON. Two renderings: "clean" (black on white, Pillow's default font at size 36, 64 px
high, as in tests/rewards) and "degraded" (size 20 in 40 px, dark red on a light blue background, Gaussian blur of
radius 1 and pixel noise of std 0.08, seeded).

    python scripts/measure_ocr_separation.py [--backends rapidocr tesseract] [--json runs/bench/ocr_separation.json]

A backend that cannot be built here (tesseract without its binary) is reported with its error instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from flowrl.registry import REWARDS
from flowrl.rewards.ocr import quoted_text

PROMPTS = [
    'a shop sign that says "OPEN"',
    'a neon sign reading "Open Late"',
    'a poster with the words "FLOW RL"',
    'a road sign that says "STOP"',
    'a coffee cup printed with "HELLO"',
    'a banner that says "GRAND OPENING"',
    'a chalkboard with "Soup of the Day"',
    'a door sign reading "QUIET ZONE"',
    'a t-shirt printed with "LOVE"',
    'a book cover titled "Deep Water"',
    'a street sign that says "Main St"',
    'a billboard reading "SALE 50%"',
    'a mug with the word "Monday"',
    'a licence plate "ABC 123"',
    'a cake with "Happy Birthday" in icing',
    'a warning sign "DANGER"',
    'a label on a jar reading "Honey"',
    'a storefront sign "Bakery"',
    'a movie poster titled "The Last Light"',
    'a protest sign "NO MORE"',
    'a menu board with "Pizza 9.99"',
    'a doormat that says "WELCOME"',
    'a bottle labelled "Olive Oil"',
    'a gate sign "PRIVATE"',
]


def render_text(text: str, degraded: bool = False, seed: int = 0) -> torch.Tensor:
    size, height = (20, 40) if degraded else (36, 64)
    font = ImageFont.load_default(size=size)
    width = max(256, int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=font)) + 20)
    image = Image.new("RGB", (width, height), (190, 215, 235) if degraded else "white")
    ImageDraw.Draw(image).text(
        (10, height // 2 - size // 2 - 2), text, fill=(120, 20, 20) if degraded else "black", font=font
    )
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255  # [3, H, W]
    if degraded:
        blurred = image.filter(ImageFilter.GaussianBlur(1))
        pixels = torch.from_numpy(np.asarray(blurred).copy()).permute(2, 0, 1).float() / 255
        noise = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(seed))
        pixels = (pixels + 0.08 * noise).clamp(0, 1)
    return pixels


def measure(backend: str, degraded: bool) -> dict:
    name = "degraded" if degraded else "clean"
    try:
        reward = REWARDS.build("ocr", backend=backend)
    except (ImportError, FileNotFoundError) as err:
        return {"backend": backend, "rendering": name, "error": str(err)}
    texts = [quoted_text(p) for p in PROMPTS]
    right, wrong, start = [], [], time.perf_counter()
    for i, prompt in enumerate(PROMPTS):
        own = render_text(texts[i], degraded, seed=2 * i)
        other = render_text(texts[(i + 1) % len(texts)], degraded, seed=2 * i + 1)
        right.append(float(reward(own[None], [prompt], [{}]).scores[0]))
        wrong.append(float(reward(other[None], [prompt], [{}]).scores[0]))
    seconds = (time.perf_counter() - start) / (2 * len(PROMPTS))
    return {
        "backend": backend,
        "rendering": name,
        "n": len(PROMPTS),
        "mean_right": round(statistics.mean(right), 4),
        "mean_wrong": round(statistics.mean(wrong), 4),
        "exact_right": sum(r == 1.0 for r in right),
        "min_right": round(min(right), 4),
        "max_wrong": round(max(wrong), 4),
        "seconds_per_image": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["rapidocr", "tesseract"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(b, degraded) for degraded in (False, True) for b in args.backends]
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
