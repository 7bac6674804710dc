"""The sample grid PNG: blocks (base, then a checkpoint) side by side, rows = prompts, columns = seeds, each
cell captioned with its rewards; videos show as frame strips. Also how numbers are written everywhere."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from flowrl.report.runs import EvalRecord


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


class GlyphPainter:
    """Draws text by pasting cached per-character masks: about 3x faster than FreeType per call for the
    thousands of short caption lines of a large grid (no kerning; the default font barely uses it)."""

    def __init__(self, font: ImageFont.FreeTypeFont):
        self.font = font
        ascent, descent = font.getmetrics()
        self.height = ascent + descent
        self.glyphs: dict[str, tuple[Image.Image, float, int]] = {}  # char -> (mask, advance, left bearing)

    def _glyph(self, char: str) -> tuple[Image.Image, float, int]:
        if char not in self.glyphs:
            advance = self.font.getlength(char)
            left = min(0, self.font.getbbox(char)[0])
            mask = Image.new("L", (max(1, math.ceil(advance) + 2 - left), self.height), 0)
            ImageDraw.Draw(mask).text((-left, 0), char, fill=255, font=self.font)
            self.glyphs[char] = (mask, advance, left)
        return self.glyphs[char]

    def length(self, text: str) -> float:
        return sum(self._glyph(c)[1] for c in text)

    def draw(self, image: Image.Image, xy: tuple[int, int], text: str, fill=(0, 0, 0)) -> None:
        x, y = xy
        for char in text:
            mask, advance, left = self._glyph(char)
            if char != " ":
                x0 = round(x) + left
                image.paste(fill, (x0, y, x0 + mask.width, y + mask.height), mask)
            x += advance


def fmt(value: float | None) -> str:
    """How every number appears in the report: 3 significant digits; n/a for not applicable."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def fmt_delta(value: float | None) -> str:
    """A change: 3 significant digits with its sign; n/a for not applicable."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:+.3g}"


def display_height(height: int, thumb: int, min_height: int = 64) -> int:
    """Height an image is shown at: shrunk to `thumb` when taller; small ones (toy 32x32) enlarged by an
    integer factor to at least `min_height`, so that pixels stay square and sharp."""
    if height > thumb:
        return thumb
    return height * max(1, math.ceil(min(min_height, thumb) / height))


def _open_thumbnail(path: Path, thumb: int) -> Image.Image | None:
    if not path.is_file():
        return None
    with Image.open(path) as image:
        image = image.convert("RGB")
        height = display_height(image.height, thumb)
        if height != image.height:
            width = max(1, round(image.width * height / image.height))
            resample = Image.Resampling.NEAREST if height > image.height else Image.Resampling.BICUBIC
            image = image.resize((width, height), resample)
        return image


def caption_lines(sample: dict[str, Any] | None, rewards: list[str]) -> list[str]:
    """The caption of one grid cell: one 'reward value' line per reward."""
    if sample is None:
        return ["no sample"]
    return [f"{name} {fmt(sample.get('scores', {}).get(name))}" for name in rewards]


def render_grid(
    blocks: list[EvalRecord],
    prompts: list[str],
    seeds: list[int],
    rewards: list[str],
    thumb: int = 128,
    font_size: int = 12,
) -> tuple[Image.Image, dict[str, Any]]:
    """Blocks (checkpoints) side by side; in each, rows = prompts and columns = seeds. Runs of edit and image-to-video
    models (scores.json "sources") show each prompt's source image in a column before the blocks.

    Returns the grid and its geometry: `cells[(block, prompt_index, seed_index)] = (x0, y0, x1, y1)` of the
    image box and `captions[...]` the caption lines drawn under it (text starting at (x0, y1 + pad)).
    """
    font, title_font = _font(font_size), _font(font_size + 2)
    painter = GlyphPainter(font)
    pad, line_h = 4, font_size + 4
    images: dict[tuple[int, int, int], Image.Image | None] = {}
    captions: dict[tuple[int, int, int], list[str]] = {}
    for b, record in enumerate(blocks):
        for p, prompt in enumerate(prompts):
            for s, seed in enumerate(seeds):
                sample = record.sample(prompt, seed)
                images[b, p, s] = _open_thumbnail(record.path / sample["image"], thumb) if sample else None
                captions[b, p, s] = (
                    caption_lines(sample, rewards)
                    if images[b, p, s] is not None or sample is None
                    else ["missing image"] + caption_lines(sample, rewards)
                )
    sources = _source_thumbnails(blocks, prompts, thumb)  # [P] the edit / image-to-video source of each prompt
    present = [im for im in [*images.values(), *sources] if im is not None]
    image_w = max((im.width for im in present), default=thumb)
    image_h = max((im.height for im in present), default=thumb)
    text_w = max((painter.length(line) for lines in captions.values() for line in lines), default=0)
    cell_w = math.ceil(max(image_w, text_w)) + 3 * pad
    max_lines = max((len(lines) for lines in captions.values()), default=1)
    cell_h = image_h + pad + max_lines * line_h + pad
    label_w, header_h, block_gap = 180, 2 * line_h + 2 * pad, 16
    source_w = cell_w + block_gap if any(im is not None for im in sources) else 0  # a source column after the labels
    width = label_w + source_w + len(blocks) * len(seeds) * cell_w + (len(blocks) - 1) * block_gap
    height = header_h + len(prompts) * cell_h
    grid = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(grid)
    cells: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
    if source_w:
        draw.text((label_w + pad, pad), "source", fill="black", font=title_font)
        for p, image in enumerate(sources):
            if image is not None:
                grid.paste(image, (label_w + pad, header_h + p * cell_h + pad))
    for b, record in enumerate(blocks):
        x_block = label_w + source_w + b * (len(seeds) * cell_w + block_gap)
        draw.text((x_block + pad, pad), record.title, fill="black", font=title_font)
        for s, seed in enumerate(seeds):
            draw.text((x_block + s * cell_w + pad, pad + line_h), f"seed {seed}", fill="black", font=font)
        for p in range(len(prompts)):
            for s in range(len(seeds)):
                x0, y0 = x_block + s * cell_w + pad, header_h + p * cell_h + pad
                box = (x0, y0, x0 + image_w, y0 + image_h)
                cells[b, p, s] = box
                image = images[b, p, s]
                if image is None:
                    draw.rectangle(box, fill=(200, 200, 200))
                else:
                    grid.paste(image, (x0, y0))
                for k, line in enumerate(captions[b, p, s]):
                    painter.draw(grid, (x0, box[3] + pad + k * line_h), line)
    for p, prompt in enumerate(prompts):
        y = header_h + p * cell_h + pad
        for k, line in enumerate(_wrap(prompt, font, label_w - 2 * pad)[: max(1, (cell_h - pad) // line_h)]):
            draw.text((pad, y + k * line_h), line, fill="black", font=font)
    return grid, {
        "cells": cells,
        "captions": captions,
        "cell_size": (cell_w, cell_h),
        "image_size": (image_w, image_h),
        "line_height": line_h,
        "pad": pad,
    }


def _source_thumbnails(blocks: list[EvalRecord], prompts: list[str], thumb: int) -> list[Image.Image | None]:
    """Each prompt's source image (scores.json "sources"), from the first block that has one; None where none."""
    paths: dict[str, Path] = {}
    for record in reversed(blocks):  # the first block wins
        for prompt, name in zip(record.scores.get("prompts", []), record.scores.get("sources") or []):
            if name and (record.path / name).is_file():
                paths[prompt] = record.path / name
    return [_open_thumbnail(paths[p], thumb) if p in paths else None for p in prompts]


def _wrap(text: str, font: ImageFont.ImageFont, width: int) -> list[str]:
    lines, current = [], ""
    for word in text.split():
        trial = f"{current} {word}".strip()
        if current and font.getlength(trial) > width:
            lines.append(current)
            current = word
        else:
            current = trial
    return lines + ([current] if current else [])
