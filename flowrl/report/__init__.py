"""The report of a run folder: grid_<step>.png files and one self-contained index.html.

    flowrl report RUN_DIR [--compare RUN_DIR ...] [--out DIR] [--steps 100 200] [--hacking-margin 0.02]
                  [--hacking-pair toy_exact=toy_attributes ...]

Reads the run folder layout the trainer writes (config.yaml, metrics.jsonl, checkpoints/step_XXXXXX/,
eval/base/ and eval/step_XXXXXX/ with scores.json from `flowrl.training.evaluation`) and writes to --out (default
RUN_DIR/report/):

- grid_<step>.png (grid_<run>_<step>.png for compared runs): rows = prompts, columns = seeds, each cell
  captioned with its rewards; the base block and the checkpoint's block side by side (videos as frame strips);
- index.html: one file with every image inline (base64 data URIs, no scripts, no external CSS/fonts):
  overall table, reward-hacking panel, reward/KL curves (and, comparing runs, a Pareto scatter per reward pair of
  the final evals), the rollout drift (each `drift/...` metric's last and largest value and its curve,
  docs/math.md#rollout-drift), per-reward tables with the change from base (per
  prompt and overall), the sample grids (videos as strips plus the animated GIF), the run's config and the
  environment, and a "Gaps" list naming every missing piece of the run folder.

Malformed input (no eval/, a scores.json that is not JSON or breaks the format, a broken metrics.jsonl
line before the last) raises ValueError / FileNotFoundError with one line naming the file and the fix.

Reward hacking: at each eval step after base, a gold reward or the diversity is flagged when the one-sided 95%
lower bound of a paired bootstrap of its fall (per sample; per prompt for the diversity) is above `hacking_margin`
(absolute, in the reward's units) while at least one training reward rose; a gold reward paired with a training
reward (`hacking_pairs`) is also flagged when the same bound on the training reward's gain over it, on the same
samples, is above the margin. The panel lists the samples that moved most (`flowrl.report.hacking`). When the run's
summary.json holds per-sample held-out reads (as `flowrl demo` writes), the panel also tests, per attribute, the gap
between the training judge's and the gold checker's change, and the rise of impossible counts (`flowrl.report.heldout`).

Modules: runs (reading a run folder), scores (checking scores.json), grid (grid PNGs and number format),
curves (training and drift curves), hacking (the panel's rules, plot and HTML), heldout (the panel's held-out reads),
page (index.html), writer (build_report).
"""

from flowrl.report.curves import curves_png, draw_pareto, drift_png, pareto_front, pareto_png
from flowrl.report.grid import GlyphPainter, caption_lines, display_height, fmt, fmt_delta, render_grid
from flowrl.report.hacking import check_pairs, hacking_png, hacking_rows, paired_gains
from flowrl.report.heldout import heldout_tests
from flowrl.report.page import CSS, PACKAGES, data_uri, environment
from flowrl.report.runs import DIVERSITY, EvalRecord, RunRecord, load_run, read_metrics
from flowrl.report.scores import read_scores, scores_problem
from flowrl.report.writer import build_report, write_report

__all__ = [
    "CSS",
    "DIVERSITY",
    "PACKAGES",
    "EvalRecord",
    "GlyphPainter",
    "RunRecord",
    "build_report",
    "caption_lines",
    "check_pairs",
    "curves_png",
    "draw_pareto",
    "drift_png",
    "data_uri",
    "display_height",
    "environment",
    "fmt",
    "fmt_delta",
    "hacking_png",
    "hacking_rows",
    "heldout_tests",
    "load_run",
    "paired_gains",
    "pareto_front",
    "pareto_png",
    "read_metrics",
    "read_scores",
    "render_grid",
    "scores_problem",
    "write_report",
]
