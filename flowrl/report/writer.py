"""Writing the report folder: grid_<step>.png per shown checkpoint and one self-contained index.html."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from flowrl.report.curves import curves_png, drift_keys, drift_png, pareto_png
from flowrl.report.grid import render_grid
from flowrl.report.hacking import check_pairs, hacking_rows, hacking_section, panel_flags, run_pairs
from flowrl.report.heldout import heldout_section, heldout_tests
from flowrl.report.page import (
    drift_section,
    environment,
    esc,
    eval_environments,
    page_html,
    samples_section,
    tables_section,
)
from flowrl.report.runs import RunRecord, load_run


def _unique_names(runs: list[RunRecord]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        if run.name in seen:
            seen[run.name] += 1
            run.name = f"{run.name}-{seen[run.name]}"
        else:
            seen[run.name] = 1


def build_report(
    run_dir: str | os.PathLike,
    compare: list[str | os.PathLike] | None = None,
    out_dir: str | os.PathLike | None = None,
    *,
    steps: list[int] | None = None,
    hacking_margin: float = 0.02,
    hacking_pairs: dict[str, str] | None = None,
    thumb: int = 128,
) -> dict[str, Any]:
    """Write grid PNGs and index.html for a run (and compared runs); returns paths, gaps and flags.

    `steps` picks the checkpoints shown beside base in the grids (default: every evaluated step).
    `hacking_pairs` maps a gold reward to the training reward it also measures (e.g. {"toy_exact":
    "toy_attributes"}): the hacking panel then flags the pair's gap too (`flowrl.report.hacking`, rule 2).
    Returns {"index", "grids", "gaps", "flags": {run: [(eval, reward)]}, "flag_reasons": {run: [(eval,
    reward, reason)]}, "seconds", "index_bytes"}.
    """
    if not (isinstance(hacking_margin, (int, float)) and hacking_margin >= 0):
        raise ValueError(f"hacking_margin={hacking_margin!r} must be a number >= 0, e.g. 0.02")
    if thumb < 8:
        raise ValueError(f"thumb={thumb} is too small; use at least 8 pixels")
    start = time.perf_counter()
    runs = [load_run(run_dir)] + [load_run(d) for d in compare or []]
    _unique_names(runs)
    pairs = check_pairs(hacking_pairs, runs)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    grids: list[str] = []
    sections: dict[str, list[str]] = {"hacking": [], "tables": [], "samples": [], "config": []}
    flags: dict[str, list[tuple[str, str]]] = {}
    reasons: dict[str, list[tuple[str, str, str]]] = {}
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
        mine = run_pairs(run, pairs)
        rows = hacking_rows(run, hacking_margin, mine)
        held = heldout_tests(run.summary, hacking_margin)  # None unless summary.json has held-out reads (flowrl demo)
        reasons[run.name] = panel_flags(rows, held)
        flags[run.name] = list(dict.fromkeys((step, n) for step, n, _ in reasons[run.name]))
        title = f'<h3 id="run-{esc(run.name)}">{esc(run.name)}</h3>'
        panel = hacking_section(run, rows, hacking_margin, mine, held) + heldout_section(held, run.name)
        sections["hacking"].append(title + panel)
        sections["tables"].append(title + tables_section(run))
        sections["samples"].append(title + samples_section(run, reference + later, thumb))
        config = esc(run.config_text) if run.config_text is not None else "(config.yaml missing)"
        summary = f"<h4>summary.json</h4><pre>{esc(json.dumps(run.summary, indent=1))}</pre>" if run.summary else ""
        sections["config"].append(f"{title}<pre>{config}</pre>{summary}{eval_environments(run)}")
    drift = drift_section(runs, drift_keys(runs), drift_png(runs))
    page = page_html(runs, gaps, sections, curves_png(runs), environment(), grids, pareto_png(runs), drift)
    (out / "index.html").write_text(page, encoding="utf-8")
    return {
        "index": str(out / "index.html"),
        "grids": [str(out / g) for g in grids],
        "gaps": gaps,
        "flags": flags,
        "flag_reasons": reasons,
        "seconds": round(time.perf_counter() - start, 3),
        "index_bytes": (out / "index.html").stat().st_size,
    }


def write_report(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike | None = None, **options: Any) -> Path:
    """The first run compared with the others (as `flowrl report RUN --compare ...`); returns index.html's path."""
    if not run_dirs:
        raise ValueError("write_report: run_dirs is empty; pass at least one runs/<name> folder")
    return Path(build_report(run_dirs[0], list(run_dirs[1:]), out_dir, **options)["index"])
