"""The self-contained index.html: every image inline as a data URI, no scripts, no external CSS or fonts.

The sections other than the reward-hacking panel (`flowrl.report.hacking`) are rendered here: overview,
per-reward tables, sample grids, config and environment, and the page around them.
"""

from __future__ import annotations

import base64
import html
import io
import math
import platform
import sys
from pathlib import Path
from typing import Any

from PIL import Image

from flowrl.report.grid import caption_lines, display_height, fmt, fmt_delta
from flowrl.report.runs import DIVERSITY, EvalRecord, RunRecord

PACKAGES = (
    "flowrl",
    "torch",
    "torchvision",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",
    "open_clip_torch",
    "numpy",
    "pillow",
    "matplotlib",
    "imageio",
    "imageio-ffmpeg",
)


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_tag(path: Path, thumb: int, alt: str | None = None) -> str | None:
    """An <img> with the file inline as a data URI; shrunk to `thumb` pixels high when larger (GIFs keep their
    frames), small images shown enlarged with square pixels; `alt` defaults to the file name. None when the file
    is missing."""
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

                frames = [
                    f.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
                    for f in ImageSequence.Iterator(image)
                ]
                frames[0].save(
                    buffer,
                    format="GIF",
                    save_all=True,
                    append_images=frames[1:],
                    duration=image.info.get("duration", 125),
                    loop=0,
                )
            else:
                image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC).save(buffer, format="PNG")
            raw = buffer.getvalue()
    return (
        f'<img alt="{esc(path.name if alt is None else alt)}" width="{width}" height="{height}" '
        f'src="{data_uri(raw, mime)}">'
    )


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def num_td(value: float | None, **data: Any) -> str:
    attrs = "".join(f' data-{k}="{esc(v)}"' for k, v in data.items())
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
.hacking-evidence img{image-rendering:pixelated}
"""


def tables_section(run: RunRecord) -> str:
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
        head = "".join(f"<th>{esc(r.title)}</th>" for r in run.evals)
        head += "".join(f"<th>&Delta; {esc(r.title)}</th>" for r in later)
        body = []
        for p, prompt in enumerate(prompts + [None]):
            cells = []
            for r in run.evals:
                value = r.overall(name) if prompt is None else r.prompt_value(name, prompt)
                cells.append(
                    num_td(value, run=run.name, step=r.name, reward=name, prompt="all" if prompt is None else p)
                )
            for r in later:
                value = r.overall(name) if prompt is None else r.prompt_value(name, prompt)
                ref = reference.overall(name) if prompt is None else reference.prompt_value(name, prompt)
                cells.append(
                    num_td(
                        _delta(value, ref),
                        run=run.name,
                        step=r.name,
                        reward=name,
                        prompt="all" if prompt is None else p,
                        kind="delta",
                    )
                )
            label = "<b>overall</b>" if prompt is None else esc(prompt)
            body.append(f"<tr><td>{label}</td>{''.join(cells)}</tr>")
        parts.append(
            f'<h4>{esc(name)} <small>({kind})</small></h4><table class="rewards" data-reward="{esc(name)}">'
            f"<tr><th>prompt</th>{head}</tr>{''.join(body)}</table>"
        )
    return "".join(parts)


def samples_section(run: RunRecord, blocks: list[EvalRecord], thumb: int) -> str:
    """HTML grid: rows = prompts; per block (checkpoint) one column per seed; captions under each image."""
    if not blocks:
        return "<p>No evaluations.</p>"
    train, gold = run.reward_names()
    rewards = train + gold
    prompts, seeds = blocks[0].scores.get("prompts", []), blocks[0].scores.get("seeds", [])
    head1 = "".join(f'<th colspan="{len(seeds)}">{esc(b.title)}</th>' for b in blocks)
    head2 = "".join(f"<th>seed {esc(s)}</th>" for _ in blocks for s in seeds)
    sources = {}  # edit / image-to-video runs: each prompt's source image (scores.json "sources"), shown first
    for b in reversed(blocks):
        for prompt, name in zip(b.scores.get("prompts", []), b.scores.get("sources") or []):
            if name:
                sources[prompt] = b.path / name
    if sources:
        head1 = f'<th rowspan="2">source</th>{head1}'
    body = []
    for prompt in prompts:
        cells = []
        if sources:
            tag = image_tag(sources[prompt], thumb) if prompt in sources else None
            missing = '<span class="missing">no source</span>'
            cells.append(f"<td>{tag or missing}</td>")
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
                    tag = image_tag(b.path / sample[key], thumb)
                    media.append(tag or f'<span class="missing gap">missing {esc(sample[key])}</span>')
                caption = esc("\n".join(caption_lines(sample, rewards)))
                cells.append(f'<td>{"<br>".join(media)}<div class="cap">{caption}</div></td>')
        body.append(f"<tr><td>{esc(prompt)}</td>{''.join(cells)}</tr>")
    return f'<table class="grid"><tr><th rowspan="2">prompt</th>{head1}</tr><tr>{head2}</tr>{"".join(body)}</table>'


def environment() -> dict[str, str]:
    """Package versions, Python and platform of the machine building the report (torch is not imported for it;
    the device each evaluation ran on is in its scores.json)."""
    from flowrl.environment import package_versions

    return {"python": sys.version.split()[0], "platform": platform.platform(), **package_versions(PACKAGES)}


def eval_environments(run: RunRecord) -> str:
    """Where each evaluation ran: scores.json "environment" (device, dtype, versions)."""
    rows = [(r.title, r.scores["environment"]) for r in run.evals if isinstance(r.scores.get("environment"), dict)]
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for _, env in rows for k in env))
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = "".join(
        f"<tr><td>{esc(t)}</td>" + "".join(f"<td>{esc(env.get(k, ''))}</td>" for k in keys) + "</tr>" for t, env in rows
    )
    return f"<h4>Evaluation environment</h4><table><tr><th>eval</th>{head}</tr>{body}</table>"


def overview(runs: list[RunRecord]) -> str:
    """Every run x eval with each reward's overall mean (training rewards marked *)."""
    names: list[str] = []
    train_all: set[str] = set()
    for run in runs:
        train, gold = run.reward_names()
        train_all |= set(train)
        names += [n for n in train + gold if n not in names]
    names.append(DIVERSITY)
    head = "".join(f"<th>{esc(n)}{' *' if n in train_all else ''}</th>" for n in names)
    body = []
    for run in runs:
        for r in run.evals:
            cells = "".join(
                num_td(r.overall(n), run=run.name, step=r.name, reward=n, prompt="all", kind="overview") for n in names
            )
            body.append(f"<tr><td>{esc(run.name)}</td><td>{esc(r.title)}</td>{cells}</tr>")
    return (
        f'<table class="overview"><tr><th>run</th><th>eval</th>{head}</tr>{"".join(body)}</table>'
        "<p>* training reward; the others are gold (eval-only) rewards.</p>"
    )


def drift_section(runs: list[RunRecord], keys: list[str], plot: bytes | None) -> str:
    """The rollout drift: each run's last and largest value of every `drift/...` metric (docs/math.md#rollout-drift),
    and their curves (`plot`)."""
    if not keys:
        return "<p>No drift/* metrics logged.</p>"
    body = []
    for run in runs:
        cells = []
        for key in keys:
            values = [r[key] for r in run.metrics if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            last, top = (values[-1], max(values)) if values else (None, None)
            cells.append(num_td(last, run=run.name, metric=key, kind="last"))
            cells.append(num_td(top, run=run.name, metric=key, kind="max"))
        body.append(f"<tr><td>{esc(run.name)}</td>{''.join(cells)}</tr>")
    head = "".join(f'<th colspan="2">{esc(key)}</th>' for key in keys)
    sub = "<th>last</th><th>max</th>" * len(keys)
    table = f'<table class="drift"><tr><th>run</th>{head}</tr><tr><th></th>{sub}</tr>{"".join(body)}</table>'
    image = f'<img class="plot" alt="rollout drift: {esc(", ".join(keys))}" src="{data_uri(plot, "image/png")}">'
    return (
        "<p>How far the model that made each step's rollout is from the model the step's first optimizer step "
        "trains: |Δ log p| of the trained transitions (ratio-based recipes) or ||v_rollout − v|| / ||v|| "
        "(velocity-based ones); 0 for on-policy full-precision rollouts.</p>" + table + (image if plot else "")
    )


def page_html(
    runs: list[RunRecord],
    gaps: list[tuple[str, str]],
    sections: dict[str, list[str]],
    curves: bytes | None,
    env: dict[str, str],
    grids: list[str],
    pareto: bytes | None = None,
    drift: str = "",
) -> str:
    names = ", ".join(run.name for run in runs)
    gap_html = (
        "<ul>" + "".join(f'<li class="gap">{esc(run)}: {esc(text)}</li>' for run, text in gaps) + "</ul>"
        if gaps
        else "<p>None: every file the report looks for is present.</p>"
    )
    curve_html = (
        f'<img class="plot" alt="training curves" src="{data_uri(curves, "image/png")}">'
        if curves
        else "<p>No metrics to plot.</p>"
    )
    pareto_html = (
        "<h3>Pareto fronts at the final eval</h3>"
        f'<img class="plot" alt="Pareto fronts" src="{data_uri(pareto, "image/png")}">'
        if pareto
        else ""
    )
    grid_links = " ".join(f'<a href="{esc(g)}">{esc(g)}</a>' for g in grids)
    env_rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in env.items())
    nav = " | ".join(
        f'<a href="#{s}">{s}</a>'
        for s in ("gaps", "overview", "hacking", "curves", "tables", "samples", "config", "environment")
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flowrl report: {esc(names)}</title>
<link rel="icon" href="data:,"><style>{CSS}</style></head><body>
<h1>flowrl report: {esc(names)}</h1>
<p>{nav}</p>
<h2 id="gaps">Gaps</h2>{gap_html}
<h2 id="overview">Overview</h2>{overview(runs)}
<h2 id="hacking">Reward hacking</h2>{"".join(sections["hacking"])}
<h2 id="curves">Reward and KL curves</h2>{curve_html}{pareto_html}
<h3 id="drift">Rollout drift</h3>{drift}
<h2 id="tables">Per-reward tables (change from base)</h2>{"".join(sections["tables"])}
<h2 id="samples">Samples</h2><p>Grid files: {grid_links}</p>{"".join(sections["samples"])}
<h2 id="config">Config</h2>{"".join(sections["config"])}
<h2 id="environment">Environment (machine that built this report)</h2><table>{env_rows}</table>
</body></html>
"""
