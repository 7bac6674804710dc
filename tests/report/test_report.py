"""flowrl.report without a browser: grid geometry and captions (pixels and OCR), gaps, reward hacking, compare, CLI."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pytest
from fabricated_runs import GOLD, TRAIN, colour, fabricate_run
from PIL import Image

from flowrl.cli import _eval_out_dir, main
from flowrl.report import build_report, hacking_rows, load_run, read_metrics, render_grid

PROMPTS = ["one red circle", "two blue squares"]
SEEDS = [0, 7, 9]


class Cells(HTMLParser):
    """Collects td.num cells (data attributes + text), li.gap texts and <img> sources of a page."""

    def __init__(self, page: str):
        super().__init__()
        self.cells, self.gaps, self.images, self._open = [], [], [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "td" and "num" in (attrs.get("class") or "").split() and "data-reward" in attrs:
            self._open = {k[5:]: v for k, v in attrs.items() if k.startswith("data-")} | {"text": ""}
        elif tag == "li" and attrs.get("class") == "gap":
            self._open = {"gap": ""}
        elif tag == "img":
            self.images.append(attrs.get("src", ""))

    def handle_data(self, data):
        if self._open is not None:
            self._open["gap" if "gap" in self._open else "text"] += data

    def handle_endtag(self, tag):
        if tag in ("td", "li") and self._open is not None:
            (self.gaps.append(self._open["gap"]) if "gap" in self._open else self.cells.append(self._open))
            self._open = None


def _ocr(image: Image.Image) -> str:
    pytesseract = pytest.importorskip("pytesseract")
    return pytesseract.image_to_string(
        image.resize((image.width * 3, image.height * 3), Image.Resampling.LANCZOS), config="--psm 6"
    )


def test_image_grid_geometry_pixels_and_captions(tmp_path, require_program):
    values = lambda k, p, s: {TRAIN: 0.25 + k + 0.125 * p + 0.0625 * s, GOLD: -1.5 - k + 0.5 * s}  # noqa: E731
    run_dir = fabricate_run(tmp_path, "img", prompts=PROMPTS, seeds=SEEDS, steps=[0, 10], scores_fn=values)
    result = build_report(run_dir, out_dir=tmp_path / "out")
    assert [p.rsplit("/", 1)[1] for p in result["grids"]] == ["grid_000010.png"]
    on_disk = Image.open(tmp_path / "out" / "grid_000010.png").convert("RGB")
    run = load_run(run_dir)
    grid, geometry = render_grid(run.evals, PROMPTS, SEEDS, [TRAIN, GOLD])
    assert grid.size == on_disk.size
    pixels = np.asarray(on_disk)
    cells = geometry["cells"]
    assert len(cells) == 2 * len(PROMPTS) * len(SEEDS)  # base block and step block, rows = prompts, columns = seeds
    for (b, p, s), (x0, y0, x1, y1) in cells.items():
        assert (x1 - x0, y1 - y0) == (64, 64)  # 16 px samples shown 4x with square pixels
        assert tuple(pixels[(y0 + y1) // 2, (x0 + x1) // 2]) == colour(b, p, s)
        assert tuple(pixels[y0, x0]) == colour(b, p, s) and tuple(pixels[y1 - 1, x1 - 1]) == colour(b, p, s)
        if s > 0:
            assert cells[b, p, s - 1][2] <= x0 and cells[b, p, s - 1][1] == y0  # seeds left to right in one row
        if p > 0:
            assert cells[b, p - 1, s][3] < y0 and cells[b, p - 1, s][0] == x0  # prompts top to bottom
        if b > 0:
            assert cells[b - 1, p, len(SEEDS) - 1][2] < x0  # the step block to the right of base
        expected = [f"{TRAIN} {values(b, p, s)[TRAIN]:.3g}", f"{GOLD} {values(b, p, s)[GOLD]:.3g}"]
        assert geometry["captions"][b, p, s] == expected
    require_program("tesseract", "apt-get install -y tesseract-ocr")
    for key in [(0, 0, 0), (1, 1, 2)]:  # the captions are really drawn under the images
        x0, y0, x1, y1 = cells[key]
        text = _ocr(on_disk.crop((x0 - 2, y1, x0 + geometry["cell_size"][0] - 4, y0 + geometry["cell_size"][1] - 4)))
        assert text.split() == " ".join(geometry["captions"][key]).split()


def test_video_grid_shows_frame_strips(tmp_path):
    run_dir = fabricate_run(tmp_path, "vid", prompts=PROMPTS, seeds=SEEDS[:2], steps=[0, 4], video=True, num_frames=3)
    build_report(run_dir, out_dir=tmp_path / "out")
    pixels = np.asarray(Image.open(tmp_path / "out" / "grid_000004.png").convert("RGB"))
    run = load_run(run_dir)
    _, geometry = render_grid(run.evals, PROMPTS, SEEDS[:2], [TRAIN, GOLD])
    for (b, p, s), (x0, y0, x1, y1) in geometry["cells"].items():
        assert (x1 - x0, y1 - y0) == (3 * 64, 64)  # three 16 px frames side by side, shown 4x
        for f in range(3):
            assert tuple(pixels[(y0 + y1) // 2, x0 + 64 * f + 32]) == colour(b, p, s, f)
    page = Cells((tmp_path / "out" / "index.html").read_text())
    gifs = [src for src in page.images if src.startswith("data:image/gif;base64,")]
    assert len(gifs) == 2 * len(PROMPTS) * 2  # one animation per sample of base and step 4


def test_hacking_flags_follow_the_margin_by_hand(tmp_path):
    # training reward +0.1 per eval; gold -0.015 per eval; diversity (fabricated) -0.1 per eval
    values = lambda k, p, s: {TRAIN: 0.5 + 0.1 * k, GOLD: 0.9 - 0.015 * k}  # noqa: E731
    run = load_run(fabricate_run(tmp_path, "h", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1, 2], scores_fn=values))
    rows = hacking_rows(run, margin=0.02)
    assert [r["name"] for r in rows] == ["step_000001", "step_000002"]
    assert rows[0]["train"][TRAIN][1] == pytest.approx(0.1) and rows[1]["watch"][GOLD][1] == pytest.approx(-0.03)
    assert rows[0]["flagged"] == ["diversity"]  # gold fell 0.015 < margin
    assert rows[1]["flagged"] == [GOLD, "diversity"]  # gold fell 0.03 > margin
    assert all(r["flagged"] == [] for r in hacking_rows(run, margin=0.5))
    falling = lambda k, p, s: {TRAIN: 0.5 - 0.1 * k, GOLD: 0.9 - 0.2 * k}  # noqa: E731  training reward falls too
    run = load_run(fabricate_run(tmp_path, "f", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1], scores_fn=falling))
    assert hacking_rows(run, margin=0.02)[0]["flagged"] == []


def test_gaps_missing_image_truncated_metrics_missing_checkpoint(tmp_path):
    run_dir = fabricate_run(tmp_path, "gappy", prompts=PROMPTS, seeds=SEEDS, steps=[0, 5, 10])
    (run_dir / "eval" / "step_000005" / "p001_s002.png").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "train/lo')  # a crash mid-line
    shutil.rmtree(run_dir / "checkpoints" / "step_000010")
    (run_dir / "eval" / "step_000011").mkdir()  # a crash during an eval: images written, scores.json not yet
    Image.new("RGB", (16, 16)).save(run_dir / "eval" / "step_000011" / "p000_s000.png")
    assert main(["report", str(run_dir)]) == 0
    page_text = (run_dir / "report" / "index.html").read_text()
    page = Cells(page_text)
    expected = [
        "eval/step_000005/p001_s002.png is missing",
        "metrics.jsonl line 11 is not valid JSON",
        "checkpoints/step_000010/ is missing",
        "eval/step_000011/scores.json is missing",
    ]
    for text in expected:
        assert sum(text in gap for gap in page.gaps) == 1, (text, page.gaps)
    assert "missing p001_s002.png" in page_text  # stated in the grid cell too, instead of a broken image
    assert all(src.startswith("data:image/") and len(src) > 40 for src in page.images)
    metrics, gaps = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11)) and len(gaps) == 1
    grid = np.asarray(Image.open(run_dir / "report" / "grid_000005.png").convert("RGB"))
    _, geometry = render_grid(load_run(run_dir).evals[:2], PROMPTS, SEEDS, [TRAIN, GOLD])
    x0, y0, x1, y1 = geometry["cells"][1, 1, 2]
    assert tuple(grid[(y0 + y1) // 2, (x0 + x1) // 2]) == (200, 200, 200)  # grey placeholder
    assert geometry["captions"][1, 1, 2][0] == "missing image"


def test_compare_shows_both_runs(tmp_path, capsys):
    a = fabricate_run(tmp_path, "alpha", prompts=PROMPTS, seeds=SEEDS, steps=[0, 10])
    b = fabricate_run(
        tmp_path,
        "beta",
        prompts=PROMPTS,
        seeds=SEEDS[:2],
        steps=[0, 20],
        video=True,
        scores_fn=lambda k, p, s: {TRAIN: 2.0 + k, GOLD: 3.0 + p},
    )
    assert main(["report", str(a), "--compare", str(b), "--out", str(tmp_path / "cmp")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cmp" / "index.html")
    assert (tmp_path / "cmp" / "grid_000010.png").is_file() and (tmp_path / "cmp" / "grid_beta_000020.png").is_file()
    page = Cells((tmp_path / "cmp" / "index.html").read_text())
    for run_dir, name in ((a, "alpha"), (b, "beta")):
        for folder in ("base", "step_000010" if name == "alpha" else "step_000020"):
            scores = json.loads((run_dir / "eval" / folder / "scores.json").read_text())
            for reward in (TRAIN, GOLD):
                shown = [
                    c
                    for c in page.cells
                    if c.get("run") == name
                    and c["step"] == folder
                    and c["reward"] == reward
                    and c.get("prompt") == "all"
                    and c.get("kind") == "overview"
                ]
                assert len(shown) == 1 and float(shown[0]["text"]) == pytest.approx(scores["means"][reward], rel=1e-3)


def test_write_report_is_the_library_entry(tmp_path):
    from flowrl.report import write_report

    a = fabricate_run(tmp_path, "alpha", prompts=PROMPTS[:1], seeds=SEEDS[:2], steps=[0, 1])
    b = fabricate_run(tmp_path, "beta", prompts=PROMPTS[:1], seeds=SEEDS[:2], steps=[0, 1])
    index = write_report([a, b], tmp_path / "w")
    assert index == tmp_path / "w" / "index.html" and index.is_file()
    assert {c.get("run") for c in Cells(index.read_text()).cells} == {"alpha", "beta"}
    with pytest.raises(ValueError, match="run_dirs is empty"):
        write_report([])


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nope" in err and "does not exist" in err
    run_dir = fabricate_run(tmp_path, "r", prompts=PROMPTS[:1], seeds=SEEDS[:2], steps=[0])
    assert main(["report", str(run_dir), "--hacking-margin", "-1"]) == 2
    assert re.search(r"hacking_margin=-1.0 must be a number >= 0", capsys.readouterr().err)


def test_eval_output_folder_follows_the_run_layout(tmp_path):
    class Config:
        run_dir = tmp_path / "runs" / "demo"

    checkpoint = tmp_path / "runs" / "demo" / "checkpoints" / "step_000120"
    checkpoint.mkdir(parents=True)
    expected = (str(tmp_path / "runs" / "demo" / "eval" / "step_000120"), 120, "step_000120")
    assert _eval_out_dir(Config(), str(checkpoint), None) == expected
    assert _eval_out_dir(Config(), "base", None) == (str(tmp_path / "runs" / "demo" / "eval" / "base"), 0, "base")
    assert _eval_out_dir(object(), "base", "elsewhere") == ("elsewhere", 0, "base")
    with pytest.raises(ValueError, match="--out"):
        _eval_out_dir(object(), "base", None)
    with pytest.raises(FileNotFoundError, match="--checkpoint"):
        _eval_out_dir(Config(), str(tmp_path / "missing"), None)


def test_flowrl_eval_base_reproduces_the_runs_base_eval(evaluated_run, tiny_pipeline, tmp_path, capsys):
    import yaml

    r = evaluated_run
    config = {
        "name": "tiny_sd3",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": {"path": tiny_pipeline("sd3")},
        "data": {"prompts": ["unused"], "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
        "rewards": [{"name": "jpeg_incompressibility"}],
        "eval": {
            "prompts": r["prompts"],
            "seeds": r["seeds"],
            "num_steps": 2,
            "guidance_scale": 1.0,
            "gold_rewards": [{"name": "jpeg_compressibility"}],
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["eval", "--config", str(tmp_path / "config.yaml"), "--checkpoint", "base"]) == 0
    out = tmp_path / "runs" / "tiny_sd3" / "eval" / "base"  # run_dir/eval/base by default
    assert f"wrote {out}/scores.json" in capsys.readouterr().out
    scores = json.loads((out / "scores.json").read_text())
    assert scores["rewards"] == {"train": ["jpeg_incompressibility"], "gold": ["jpeg_compressibility"]}
    assert scores["step"] == 0 and scores["label"] == "base" and scores["sampler"]["num_steps"] == 2
    for new, old in zip(scores["samples"], r["base"]["samples"], strict=True):
        a = np.asarray(Image.open(out / new["image"]), dtype=np.int16)
        b = np.asarray(Image.open(r["run"] / "eval" / "base" / old["image"]), dtype=np.int16)
        assert np.abs(a - b).max() <= 1
    assert main(["eval", "--config", str(tmp_path / "config.yaml"), "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_steps_choice_and_large_images_shrunk_to_thumb(tmp_path):
    import base64
    import io

    from PIL import ImageSequence

    run_dir = fabricate_run(
        tmp_path, "big", prompts=PROMPTS[:1], seeds=SEEDS[:2], steps=[0, 5, 10], video=True, size=48
    )
    result = build_report(run_dir, out_dir=tmp_path / "out", steps=[10, 15], thumb=24)
    assert [p.rsplit("/", 1)[1] for p in result["grids"]] == ["grid_000010.png"]
    assert ("big", "eval/step_000015 requested with --steps does not exist") in result["gaps"]
    _, geometry = render_grid(load_run(run_dir).evals[::2], PROMPTS[:1], SEEDS[:2], [TRAIN, GOLD], thumb=24)
    grid = np.asarray(Image.open(tmp_path / "out" / "grid_000010.png").convert("RGB"))
    for (b, p, s), (x0, y0, x1, y1) in geometry["cells"].items():
        assert (x1 - x0, y1 - y0) == (3 * 24, 24)  # 48 px frames shrunk to 24
        assert tuple(grid[(y0 + y1) // 2, x0 + 12]) == colour(2 * b, p, s, 0)  # blocks: base and step 10 (eval index 2)
    page = (tmp_path / "out" / "index.html").read_text()
    sources = Cells(page).images
    decoded = [Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) for src in sources if "plot" not in src]
    strips = [im for im in decoded if im.format == "PNG" and im.size == (72, 24)]
    gifs = [im for im in decoded if im.format == "GIF"]
    assert len(strips) == 2 * 2 and len(gifs) == 2 * 2  # base and step 10 only (step 5 not chosen), 2 seeds
    assert all(im.size == (24, 24) and len(list(ImageSequence.Iterator(im))) == 3 for im in gifs)
    assert ">step 5<" not in page.split('id="samples"')[1].split('id="config"')[0]


def test_not_applicable_scores_show_as_na():
    from flowrl.report import caption_lines, fmt, fmt_delta

    assert caption_lines({"scores": {"ocr": None, "clip": 0.123456}}, ["ocr", "clip"]) == ["ocr n/a", "clip 0.123"]
    shown = (fmt(None), fmt(float("nan")), fmt(-1234.5678), fmt_delta(0.5), fmt_delta(None), fmt_delta(float("nan")))
    assert shown == ("n/a", "n/a", "-1.23e+03", "+0.5", "n/a", "n/a")
    # 3 significant digits: the demo's artifact fall of 0.02392 reads 0.0239, a change of -0.004567 reads -0.00457
    assert (fmt(0.02392), fmt(0.99851), fmt(22.149), fmt_delta(-0.004567), fmt_delta(0.1875)) == (
        "0.0239",
        "0.999",
        "22.1",
        "-0.00457",
        "+0.188",
    )


def test_a_bare_run_folder_still_yields_a_report(tmp_path):
    run_dir = tmp_path / "bare"
    (run_dir / "eval").mkdir(parents=True)  # a run stopped before its base evaluation finished
    (run_dir / "config.yaml").write_text("name: bare\n")
    result = build_report(run_dir)
    gaps = [g for _, g in result["gaps"]]
    assert len(gaps) == 3
    assert gaps[0].startswith("metrics.jsonl is missing") and gaps[1].startswith("checkpoints/ is missing")
    assert gaps[2].startswith("eval/ holds no scores.json") and result["grids"] == []
    page = Cells((run_dir / "report" / "index.html").read_text())
    assert page.gaps == [f"bare: {g}" for g in gaps] and page.images == []


def test_pareto_front_by_hand():
    from flowrl.report import pareto_front

    points = [(0.0, 1.0), (1.0, 0.0), (0.5, 0.5), (0.4, 0.4), (1.0, -1.0), (0.5, 0.5)]
    # (0.4, 0.4) is below (0.5, 0.5); (1, -1) below (1, 0); the two equal (0.5, 0.5) do not dominate each other
    assert pareto_front(points) == [0, 2, 5, 1]
    assert pareto_front([(1.0, 1.0)]) == [0] and pareto_front([]) == []


def test_compared_runs_get_a_pareto_scatter_of_their_final_evals(tmp_path):
    from flowrl.report import load_run, pareto_png

    a = fabricate_run(tmp_path, "alpha", prompts=PROMPTS, seeds=SEEDS, steps=[0, 10])
    b = fabricate_run(
        tmp_path, "beta", prompts=PROMPTS, seeds=SEEDS, steps=[0, 10], scores_fn=lambda k, p, s: {TRAIN: 1.0, GOLD: 1.0}
    )
    assert pareto_png([load_run(a)]) is None  # one run: nothing to compare
    png = pareto_png([load_run(a), load_run(b)])
    assert png[:4] == b"\x89PNG"
    page = build_report(a, [b], tmp_path / "cmp")
    html = (tmp_path / "cmp" / "index.html").read_text()
    assert page["index"] and "Pareto fronts at the final eval" in html
    single = build_report(a, [], tmp_path / "one")
    assert single["index"] and "Pareto fronts" not in (tmp_path / "one" / "index.html").read_text()
