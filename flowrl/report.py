"""The report of a run folder: grid_<step>.png files and one self-contained index.html.

    flowrl report RUN_DIR [--compare RUN_DIR ...] [--out DIR] [--steps 100 200] [--hacking-margin 0.02]

Reads the run folder layout the trainer writes (config.yaml, metrics.jsonl, checkpoints/step_XXXXXX/,
eval/base/ and eval/step_XXXXXX/ with scores.json from `flowrl.evaluation`) and writes to --out (default
RUN_DIR/report/):

- grid_<step>.png (grid_<run>_<step>.png for compared runs): rows = prompts, columns = seeds, each cell
  captioned with its rewards; the base block and the checkpoint's block side by side (videos as frame strips);
- index.html: one file with every image inline (base64 data URIs, no scripts, no external CSS/fonts):
  overall table, reward-hacking panel, reward/KL curves, per-reward tables with the change from base (per
  prompt and overall), the sample grids (videos as strips plus the animated GIF), the run's config and the
  environment, and a "Gaps" list naming every missing or damaged piece of the run folder.

Reward hacking: at each eval step after base, a gold reward or the diversity is flagged when it fell by more
than `hacking_margin` (absolute, in the reward's units) from base while at least one training reward rose.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

STEP_DIR = re.compile(r"^step_(\d{6,})$")
DIVERSITY = "diversity"  # the pseudo-reward name of per-prompt diversity in tables and the hacking panel
PACKAGES = ("flowrl", "torch", "torchvision", "diffusers", "transformers", "peft", "accelerate", "open_clip_torch",
            "numpy", "pillow", "matplotlib", "imageio", "imageio-ffmpeg")


# --------------------------------------------------------------------------------------------- reading a run
@dataclass
class EvalRecord:
    """One eval/<name>/ folder."""

    name: str  # "base" or "step_000120"
    step: int  # 0 for base
    path: Path
    scores: dict[str, Any]  # scores.json (flowrl.evaluation schema)
    by_key: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict, repr=False)  # (prompt, seed) -> sample

    def __post_init__(self) -> None:
        prompts = self.scores.get("prompts", [])
        for sample in self.scores.get("samples", []):
            self.by_key[prompts[sample["prompt_index"]], sample["seed"]] = sample

    @property
    def title(self) -> str:
        return "base" if self.name == "base" else f"step {self.step}"

    def sample(self, prompt: str, seed: int) -> dict[str, Any] | None:
        return self.by_key.get((prompt, seed))

    def prompt_value(self, reward: str, prompt: str) -> float | None:
        prompts = self.scores.get("prompts", [])
        if prompt not in prompts:
            return None
        p = prompts.index(prompt)
        if reward == DIVERSITY:
            return self.scores.get("diversity", {}).get("per_prompt", [None] * len(prompts))[p]
        return self.scores.get("per_prompt", {}).get(reward, [None] * len(prompts))[p]

    def overall(self, reward: str) -> float | None:
        if reward == DIVERSITY:
            return self.scores.get("diversity", {}).get("mean")
        return self.scores.get("means", {}).get(reward)


@dataclass
class RunRecord:
    name: str
    path: Path
    config_text: str | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)  # base first, then by step
    checkpoints: list[int] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    gaps: list[str] = field(default_factory=list)

    @property
    def base(self) -> EvalRecord | None:
        return self.evals[0] if self.evals and self.evals[0].name == "base" else None

    @property
    def reference(self) -> EvalRecord | None:
        """What changes are measured from: eval/base, else the earliest eval."""
        return self.evals[0] if self.evals else None

    def reward_names(self) -> tuple[list[str], list[str]]:
        """(training rewards, gold rewards) over all evals, in first-seen order."""
        train: list[str] = []
        gold: list[str] = []
        for record in self.evals:
            for name in record.scores.get("rewards", {}).get("train", []):
                if name not in train:
                    train.append(name)
            for name in record.scores.get("rewards", {}).get("gold", []):
                if name not in gold and name not in train:
                    gold.append(name)
        return train, gold


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """metrics.jsonl -> (rows with an int "step", gaps); a truncated or malformed line is skipped and named."""
    rows: list[dict[str, Any]] = []
    gaps: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                gaps.append(f"metrics.jsonl line {number} is not valid JSON (truncated by a crash?): skipped")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                gaps.append(f"metrics.jsonl line {number} has no integer 'step': skipped")
                continue
            rows.append(row)
    return rows, gaps


def load_run(run_dir: str | os.PathLike) -> RunRecord:
    """Read a run folder; everything missing or damaged is recorded in `RunRecord.gaps`, never raised."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run folder {str(path)!r} does not exist; pass runs/<name> written by `flowrl train`")
    run = RunRecord(name=path.resolve().name, path=path)
    config = path / "config.yaml"
    if config.is_file():
        run.config_text = config.read_text(encoding="utf-8", errors="replace")
    else:
        run.gaps.append("config.yaml is missing: the run's configuration cannot be shown")
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        run.metrics, gaps = read_metrics(metrics)
        run.gaps += gaps
    else:
        run.gaps.append("metrics.jsonl is missing: no reward or KL curves")
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        run.checkpoints = sorted(int(m.group(1)) for d in checkpoints.iterdir() if d.is_dir() and (m := STEP_DIR.match(d.name)))
    else:
        run.gaps.append("checkpoints/ is missing: no checkpoint of this run can be reloaded")
    _load_evals(run)
    summary = path / "summary.json"
    if summary.is_file():
        try:
            run.summary = json.loads(summary.read_text())
        except json.JSONDecodeError:
            run.gaps.append("summary.json is not valid JSON: not shown")
    return run


def scores_problem(scores: Any) -> str | None:
    """Why a scores.json cannot be shown (None when it follows the flowrl.evaluation schema well enough)."""
    if not isinstance(scores, dict):
        return "is not a JSON object"
    for key, kind in (("prompts", list), ("seeds", list), ("samples", list), ("rewards", dict)):
        if not isinstance(scores.get(key), kind):
            return f"has no {key!r} {kind.__name__}"
    num_prompts = len(scores["prompts"])
    for i, sample in enumerate(scores["samples"]):
        if not (isinstance(sample, dict) and isinstance(sample.get("prompt_index"), int) and 0 <= sample["prompt_index"] < num_prompts
                and "seed" in sample and isinstance(sample.get("image"), str) and isinstance(sample.get("scores", {}), dict)):
            return f"sample {i} lacks a valid prompt_index, seed, image or scores"
    for name, values in (scores.get("per_prompt") or {}).items():
        if not isinstance(values, list) or len(values) != num_prompts:
            return f"per_prompt[{name!r}] does not hold one value per prompt"
    diversity = (scores.get("diversity") or {}).get("per_prompt")
    if diversity is not None and (not isinstance(diversity, list) or len(diversity) != num_prompts):
        return "diversity.per_prompt does not hold one value per prompt"
    return None


def _load_evals(run: RunRecord) -> None:
    eval_root = run.path / "eval"
    folders = sorted(eval_root.iterdir()) if eval_root.is_dir() else []
    for folder in folders:
        match = STEP_DIR.match(folder.name)
        if not folder.is_dir() or (folder.name != "base" and not match):
            continue
        scores_path = folder / "scores.json"
        if not scores_path.is_file():
            run.gaps.append(f"eval/{folder.name}/scores.json is missing: that evaluation is left out")
            continue
        try:
            scores = json.loads(scores_path.read_text())
        except json.JSONDecodeError:
            run.gaps.append(f"eval/{folder.name}/scores.json is not valid JSON (interrupted write?): that evaluation is left out")
            continue
        problem = scores_problem(scores)
        if problem:
            run.gaps.append(f"eval/{folder.name}/scores.json {problem}: that evaluation is left out")
            continue
        step = 0 if folder.name == "base" else int(match.group(1))
        record = EvalRecord(folder.name, step, folder, scores)
        for sample in scores.get("samples", []):
            for key in ("image", "animation"):
                if key in sample and not (folder / sample[key]).is_file():
                    run.gaps.append(f"eval/{folder.name}/{sample[key]} is missing (prompt {sample['prompt_index']}, seed {sample['seed']})")
        if match and step not in run.checkpoints and (run.path / "checkpoints").is_dir():
            run.gaps.append(f"checkpoints/{folder.name}/ is missing: eval {folder.name} is shown but its weights cannot be reloaded")
        run.evals.append(record)
    run.evals.sort(key=lambda r: (r.name != "base", r.step))
    if not run.evals:
        run.gaps.append("eval/ holds no scores.json: no sample grid, tables or reward-hacking panel")
    elif run.base is None:
        run.gaps.append(f"eval/base/ is missing: changes are measured from the earliest eval, {run.evals[0].name}")


# ------------------------------------------------------------------------------------------ reward hacking
def hacking_rows(run: RunRecord, margin: float) -> list[dict[str, Any]]:
    """One row per eval after the reference: training-reward and gold/diversity values, changes and flags.

    A gold reward (or diversity) is flagged when it fell by more than `margin` from the reference while at
    least one training reward rose (change > 0).
    """
    reference = run.reference
    if reference is None:
        return []
    train, gold = run.reward_names()
    rows = []
    for record in run.evals[1:]:
        row: dict[str, Any] = {"name": record.name, "step": record.step, "train": {}, "watch": {}, "flagged": []}
        for name in train:
            value, base = record.overall(name), reference.overall(name)
            row["train"][name] = (value, None if value is None or base is None else value - base)
        rising = [n for n, (_, d) in row["train"].items() if d is not None and d > 0]
        for name in gold + [DIVERSITY]:
            value, base = record.overall(name), reference.overall(name)
            delta = None if value is None or base is None else value - base
            flagged = bool(rising) and delta is not None and delta < -margin
            row["watch"][name] = (value, delta, flagged)
            if flagged:
                row["flagged"].append(name)
        row["rising"] = rising
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- the grid
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
    """How every number appears in the report: 4 significant digits; n/a for not applicable."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def fmt_delta(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.4g}"


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


def render_grid(blocks: list[EvalRecord], prompts: list[str], seeds: list[int], rewards: list[str],
                thumb: int = 128, font_size: int = 12) -> tuple[Image.Image, dict[str, Any]]:
    """Blocks (checkpoints) side by side; in each, rows = prompts and columns = seeds.

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
                captions[b, p, s] = caption_lines(sample, rewards) if images[b, p, s] is not None or sample is None \
                    else ["missing image"] + caption_lines(sample, rewards)
    present = [im for im in images.values() if im is not None]
    image_w = max((im.width for im in present), default=thumb)
    image_h = max((im.height for im in present), default=thumb)
    text_w = max((painter.length(line) for lines in captions.values() for line in lines), default=0)
    cell_w = math.ceil(max(image_w, text_w)) + 3 * pad
    max_lines = max((len(lines) for lines in captions.values()), default=1)
    cell_h = image_h + pad + max_lines * line_h + pad
    label_w, header_h, block_gap = 180, 2 * line_h + 2 * pad, 16
    width = label_w + len(blocks) * len(seeds) * cell_w + (len(blocks) - 1) * block_gap
    height = header_h + len(prompts) * cell_h
    grid = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(grid)
    cells: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
    for b, record in enumerate(blocks):
        x_block = label_w + b * (len(seeds) * cell_w + block_gap)
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
    return grid, {"cells": cells, "captions": captions, "cell_size": (cell_w, cell_h), "image_size": (image_w, image_h),
                  "line_height": line_h, "pad": pad}


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


# ------------------------------------------------------------------------------------------------- plots
def _figure(rows: int, cols: int, width: float, height: float):
    """A matplotlib Figure rendered by Agg without pyplot: no global backend switch, no figure registry."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    return figure, figure.subplots(rows, cols, squeeze=False)


def _plot_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return buffer.getvalue()


def curves_png(runs: list[RunRecord]) -> bytes | None:
    """Training curves from metrics.jsonl: every reward/<name>/mean (with a +-std band), train/kl, train/loss."""
    from matplotlib.ticker import MaxNLocator

    keys: list[str] = []
    for run in runs:
        for row in run.metrics:
            for key in row:
                if (key.startswith("reward/") and key.endswith("/mean") or key in ("train/kl", "train/loss")) and key not in keys:
                    keys.append(key)
    if not keys:
        return None
    keys.sort(key=lambda k: (not k.startswith("reward/"), k))
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure, axes = _figure(rows, cols, 4.2 * cols, 3 * rows)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            points = [(r["step"], r[key], r.get(key[: -len("mean")] + "std")) for r in run.metrics
                      if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if not points:
                continue
            steps = [p[0] for p in points]
            ax.plot(steps, [p[1] for p in points], label=run.name, marker="." if len(points) < 30 else None)
            if all(isinstance(p[2], (int, float)) for p in points):
                ax.fill_between(steps, [p[1] - p[2] for p in points], [p[1] + p[2] for p in points], alpha=0.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    figure.tight_layout()
    return _plot_png(figure)


def hacking_png(run: RunRecord, rows: list[dict[str, Any]]) -> bytes | None:
    """Eval means over steps: training rewards, gold rewards and diversity; flagged points in red."""
    from matplotlib.ticker import MaxNLocator

    train, gold = run.reward_names()
    names = train + gold + [DIVERSITY]
    if len(run.evals) < 2:
        return None
    figure, axes = _figure(1, len(names), 3.4 * len(names), 2.8)
    flagged = {(row["step"], name) for row in rows for name in row["flagged"]}
    for ax, name in zip(axes.flat, names):
        points = [(r.step, r.overall(name)) for r in run.evals if r.overall(name) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:blue" if name in train else "tab:green")
        bad = [p for p in points if (p[0], name) in flagged]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], color="red", zorder=3, s=60, label="flagged")
            ax.legend(fontsize=7)
        kind = "training" if name in train else ("diversity" if name == DIVERSITY else "gold")
        ax.set_title(f"{name} ({kind})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    figure.tight_layout()
    return _plot_png(figure)


# -------------------------------------------------------------------------------------------------- HTML
def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _image_tag(path: Path, thumb: int) -> str | None:
    """An <img> with the file inline as a data URI; shrunk to `thumb` pixels high when larger (GIFs keep their
    frames), small images shown enlarged with square pixels. None when the file is missing."""
    if not path.is_file():
        return None
    raw = path.read_bytes()
    gif = path.suffix.lower() == ".gif"
    mime = "image/gif" if gif else "image/png"
    with Image.open(io.BytesIO(raw)) as image:
        height = display_height(image.height, thumb)
        width = max(1, round(image.width * height / image.height))
        if image.height > thumb:
            buffer = io.BytesIO()
            if gif:
                from PIL import ImageSequence

                frames = [f.convert("RGB").resize((width, height), Image.Resampling.BICUBIC) for f in ImageSequence.Iterator(image)]
                frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:],
                               duration=image.info.get("duration", 125), loop=0)
            else:
                image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="PNG")
            raw = buffer.getvalue()
    return f'<img alt="{_esc(path.name)}" width="{width}" height="{height}" src="{data_uri(raw, mime)}">'


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num_td(value: float | None, **data: Any) -> str:
    attrs = "".join(f' data-{k}="{_esc(v)}"' for k, v in data.items())
    return f'<td class="num"{attrs}>{fmt(value) if data.get("kind") != "delta" else fmt_delta(value)}</td>'


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


CSS = """
body{font-family:sans-serif;margin:1.5em;color:#222;max-width:100%}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;vertical-align:top}
td.num{text-align:right;font-family:monospace}
td.flag{background:#fdd;font-weight:bold}
.cap{font-family:monospace;font-size:11px;white-space:pre}
.gap{color:#a00}
.grid td{text-align:center}
.grid img{image-rendering:pixelated}
.missing{display:inline-block;width:64px;height:64px;background:#ccc;font-size:11px}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:12px}
img.plot{max-width:100%}
"""


def _run_tables(run: RunRecord) -> str:
    """Per reward: rows = prompts (+ overall), columns = each eval then its change from the reference."""
    reference = run.reference
    if reference is None:
        return "<p>No evaluations.</p>"
    train, gold = run.reward_names()
    prompts = reference.scores.get("prompts", [])
    later = [r for r in run.evals if r is not reference]
    parts = []
    for name in train + gold + [DIVERSITY]:
        kind = "training" if name in train else ("diversity" if name == DIVERSITY else "gold")
        head = "".join(f"<th>{_esc(r.title)}</th>" for r in run.evals)
        head += "".join(f"<th>&Delta; {_esc(r.title)}</th>" for r in later)
        body = []
        for p, prompt in enumerate(prompts + [None]):
            cells = []
            for r in run.evals:
                value = r.overall(name) if prompt is None else r.prompt_value(name, prompt)
                cells.append(_num_td(value, run=run.name, step=r.name, reward=name, prompt="all" if prompt is None else p))
            for r in later:
                value = r.overall(name) if prompt is None else r.prompt_value(name, prompt)
                ref = reference.overall(name) if prompt is None else reference.prompt_value(name, prompt)
                cells.append(_num_td(_delta(value, ref), run=run.name, step=r.name, reward=name,
                                     prompt="all" if prompt is None else p, kind="delta"))
            label = "<b>overall</b>" if prompt is None else _esc(prompt)
            body.append(f"<tr><td>{label}</td>{''.join(cells)}</tr>")
        parts.append(f'<h4>{_esc(name)} <small>({kind})</small></h4><table class="rewards" data-reward="{_esc(name)}">'
                      f"<tr><th>prompt</th>{head}</tr>{''.join(body)}</table>")
    return "".join(parts)


def _run_hacking(run: RunRecord, rows: list[dict[str, Any]], margin: float) -> str:
    if not rows:
        return "<p>Needs at least two evaluations (base and a later step).</p>"
    train, gold = run.reward_names()
    watch = gold + [DIVERSITY]
    head = "".join(f"<th>{_esc(n)} (training)</th>" for n in train) + "".join(f"<th>{_esc(n)}</th>" for n in watch)
    body = []
    for row in rows:
        cells = []
        for name in train:
            value, delta = row["train"][name]
            cells.append(f'<td class="num">{fmt(value)} ({fmt_delta(delta)})</td>')
        for name in watch:
            value, delta, flagged = row["watch"][name]
            cells.append(f'<td class="num{" flag" if flagged else ""}" data-flag="{int(flagged)}" data-run="{_esc(run.name)}" data-reward="{_esc(name)}" '
                         f'data-step="{_esc(row["name"])}" data-kind="hacking">{fmt(value)} ({fmt_delta(delta)}){" &#9888;" if flagged else ""}</td>')
        body.append(f"<tr><td>{_esc(row['name'])}</td>{''.join(cells)}</tr>")
    flagged = [(row["name"], name) for row in rows for name in row["flagged"]]
    verdict = ('<p class="gap"><b>Possible reward hacking:</b> ' + "; ".join(f"{_esc(n)} fell at {_esc(s)}" for s, n in flagged)
               + " while a training reward rose.</p>") if flagged else "<p>No gold reward or diversity fell by more than the margin while a training reward rose.</p>"
    plot = hacking_png(run, rows)
    img = f'<img class="plot" alt="hacking panel" src="{data_uri(plot, "image/png")}">' if plot else ""
    return (f"<p>Margin: {margin:g} (absolute). Values are eval means with the change from "
            f"{_esc(run.reference.title)} in brackets.</p>{verdict}<table class=\"hacking\"><tr><th>eval</th>{head}</tr>"
            f"{''.join(body)}</table>{img}")


def _run_samples(run: RunRecord, blocks: list[EvalRecord], thumb: int) -> str:
    """HTML grid: rows = prompts; per block (checkpoint) one column per seed; captions under each image."""
    if not blocks:
        return "<p>No evaluations.</p>"
    train, gold = run.reward_names()
    rewards = train + gold
    prompts, seeds = blocks[0].scores.get("prompts", []), blocks[0].scores.get("seeds", [])
    head1 = "".join(f'<th colspan="{len(seeds)}">{_esc(b.title)}</th>' for b in blocks)
    head2 = "".join(f"<th>seed {_esc(s)}</th>" for _ in blocks for s in seeds)
    body = []
    for p, prompt in enumerate(prompts):
        cells = []
        for b in blocks:
            for seed in seeds:
                sample = b.sample(prompt, seed)
                if sample is None:
                    cells.append('<td><span class="missing">no sample</span></td>')
                    continue
                media = []
                for key in ("image", "animation"):
                    if key not in sample:
                        continue
                    tag = _image_tag(b.path / sample[key], thumb)
                    media.append(tag or f'<span class="missing gap">missing {_esc(sample[key])}</span>')
                caption = _esc("\n".join(caption_lines(sample, rewards)))
                cells.append(f'<td>{"<br>".join(media)}<div class="cap">{caption}</div></td>')
        body.append(f"<tr><td>{_esc(prompt)}</td>{''.join(cells)}</tr>")
    return f'<table class="grid"><tr><th rowspan="2">prompt</th>{head1}</tr><tr>{head2}</tr>{"".join(body)}</table>'


def environment() -> dict[str, str]:
    """Package versions, Python and platform of the machine building the report (torch is not imported for it;
    the device each evaluation ran on is in its scores.json)."""
    from importlib.metadata import PackageNotFoundError, version

    env = {"python": sys.version.split()[0], "platform": platform.platform()}
    for package in PACKAGES:
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = "not installed"
    return env


def _eval_environments(run: RunRecord) -> str:
    """Where each evaluation ran: scores.json "environment" (device, dtype, versions)."""
    rows = [(r.title, r.scores["environment"]) for r in run.evals if isinstance(r.scores.get("environment"), dict)]
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for _, env in rows for k in env))
    head = "".join(f"<th>{_esc(k)}</th>" for k in keys)
    body = "".join(f"<tr><td>{_esc(t)}</td>" + "".join(f"<td>{_esc(env.get(k, ''))}</td>" for k in keys) + "</tr>"
                   for t, env in rows)
    return f"<h4>Evaluation environment</h4><table><tr><th>eval</th>{head}</tr>{body}</table>"


def _unique_names(runs: list[RunRecord]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        if run.name in seen:
            seen[run.name] += 1
            run.name = f"{run.name}-{seen[run.name]}"
        else:
            seen[run.name] = 1


def build_report(run_dir: str | os.PathLike, compare: list[str | os.PathLike] | None = None,
                 out_dir: str | os.PathLike | None = None, *, steps: list[int] | None = None,
                 hacking_margin: float = 0.02, thumb: int = 128) -> dict[str, Any]:
    """Write grid PNGs and index.html for a run (and compared runs); returns paths, gaps and flags.

    `steps` picks the checkpoints shown beside base in the grids (default: every evaluated step).
    """
    if not (isinstance(hacking_margin, (int, float)) and hacking_margin >= 0):
        raise ValueError(f"hacking_margin={hacking_margin!r} must be a number >= 0, e.g. 0.02")
    if thumb < 8:
        raise ValueError(f"thumb={thumb} is too small; use at least 8 pixels")
    start = time.perf_counter()
    runs = [load_run(run_dir)] + [load_run(d) for d in compare or []]
    _unique_names(runs)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    grids: list[str] = []
    sections: dict[str, list[str]] = {"hacking": [], "tables": [], "samples": [], "config": []}
    flags: dict[str, list[tuple[str, str]]] = {}
    gaps = [(run.name, gap) for run in runs for gap in run.gaps]
    for i, run in enumerate(runs):
        later = [r for r in run.evals if r is not run.reference]
        if steps:
            missing = [s for s in steps if s not in {r.step for r in later}]
            gaps += [(run.name, f"eval/step_{s:06d} requested with --steps does not exist") for s in missing]
            later = [r for r in later if r.step in steps]
        reference = [run.reference] if run.reference else []
        train, gold = run.reward_names()
        prompts = run.reference.scores.get("prompts", []) if run.reference else []
        seeds = run.reference.scores.get("seeds", []) if run.reference else []
        for record in later or reference:
            blocks = reference + ([record] if record is not run.reference else [])
            grid, _ = render_grid(blocks, prompts, seeds, train + gold, thumb=thumb)
            tag = "base" if record.name == "base" else f"{record.step:06d}"
            name = f"grid_{tag}.png" if i == 0 else f"grid_{run.name}_{tag}.png"
            grid.save(out / name, compress_level=1)  # large grids: fast zlib level, still lossless
            grids.append(name)
        rows = hacking_rows(run, hacking_margin)
        flags[run.name] = [(row["name"], n) for row in rows for n in row["flagged"]]
        title = f'<h3 id="run-{_esc(run.name)}">{_esc(run.name)}</h3>'
        sections["hacking"].append(title + _run_hacking(run, rows, hacking_margin))
        sections["tables"].append(title + _run_tables(run))
        sections["samples"].append(title + _run_samples(run, reference + later, thumb))
        config = _esc(run.config_text) if run.config_text is not None else "(config.yaml missing)"
        summary = f"<h4>summary.json</h4><pre>{_esc(json.dumps(run.summary, indent=1))}</pre>" if run.summary else ""
        sections["config"].append(f"{title}<pre>{config}</pre>{summary}{_eval_environments(run)}")
    page = _page(runs, gaps, sections, curves_png(runs), environment(), grids)
    (out / "index.html").write_text(page, encoding="utf-8")
    return {"index": str(out / "index.html"), "grids": [str(out / g) for g in grids], "gaps": gaps, "flags": flags,
            "seconds": round(time.perf_counter() - start, 3), "index_bytes": (out / "index.html").stat().st_size}


def write_report(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike | None = None, **options: Any) -> Path:
    """The first run compared with the others (as `flowrl report RUN --compare ...`); returns index.html's path."""
    if not run_dirs:
        raise ValueError("write_report: run_dirs is empty; pass at least one runs/<name> folder")
    return Path(build_report(run_dirs[0], list(run_dirs[1:]), out_dir, **options)["index"])


def _overview(runs: list[RunRecord]) -> str:
    """Every run x eval with each reward's overall mean (training rewards marked *)."""
    names: list[str] = []
    train_all: set[str] = set()
    for run in runs:
        train, gold = run.reward_names()
        train_all |= set(train)
        names += [n for n in train + gold if n not in names]
    names.append(DIVERSITY)
    head = "".join(f"<th>{_esc(n)}{' *' if n in train_all else ''}</th>" for n in names)
    body = []
    for run in runs:
        for r in run.evals:
            cells = "".join(_num_td(r.overall(n), run=run.name, step=r.name, reward=n, prompt="all", kind="overview") for n in names)
            body.append(f"<tr><td>{_esc(run.name)}</td><td>{_esc(r.title)}</td>{cells}</tr>")
    return (f'<table class="overview"><tr><th>run</th><th>eval</th>{head}</tr>{"".join(body)}</table>'
            "<p>* training reward; the others are gold (eval-only) rewards.</p>")


def _page(runs: list[RunRecord], gaps: list[tuple[str, str]], sections: dict[str, list[str]], curves: bytes | None,
          env: dict[str, str], grids: list[str]) -> str:
    names = ", ".join(run.name for run in runs)
    gap_html = ("<ul>" + "".join(f'<li class="gap">{_esc(run)}: {_esc(text)}</li>' for run, text in gaps) + "</ul>"
                if gaps else "<p>None: every file the report looks for is present.</p>")
    curve_html = (f'<img class="plot" alt="training curves" src="{data_uri(curves, "image/png")}">' if curves
                  else "<p>No metrics to plot.</p>")
    grid_links = " ".join(f'<a href="{_esc(g)}">{_esc(g)}</a>' for g in grids)
    env_rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in env.items())
    nav = " | ".join(f'<a href="#{s}">{s}</a>' for s in ("gaps", "overview", "hacking", "curves", "tables", "samples", "config", "environment"))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flowrl report: {_esc(names)}</title>
<link rel="icon" href="data:,"><style>{CSS}</style></head><body>
<h1>flowrl report: {_esc(names)}</h1>
<p>{nav}</p>
<h2 id="gaps">Gaps</h2>{gap_html}
<h2 id="overview">Overview</h2>{_overview(runs)}
<h2 id="hacking">Reward hacking</h2>{''.join(sections['hacking'])}
<h2 id="curves">Reward and KL curves</h2>{curve_html}
<h2 id="tables">Per-reward tables (change from base)</h2>{''.join(sections['tables'])}
<h2 id="samples">Samples</h2><p>Grid files: {grid_links}</p>{''.join(sections['samples'])}
<h2 id="config">Config</h2>{''.join(sections['config'])}
<h2 id="environment">Environment (machine that built this report)</h2><table>{env_rows}</table>
</body></html>
"""
