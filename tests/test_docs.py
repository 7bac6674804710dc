"""The documentation holds together: every relative link in README.md, docs/ and rewards/README.md resolves (the
file, and the heading an `#anchor` names, by GitHub's slug rules), so does every page the comments of configs/ and
the comments and docstrings of scripts/ cite (`docs/x.md#anchor`, or a relative link), the README stays a manual of
at most 16,000 bytes, and no source file points its reader at a file outside the repository."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 16_000
# the project's planning documents live outside the repository: cited by file (DESIGN.md) or by section
# (ALGORITHMS §4.4, ALGORITHMS Decision 1), a reader of the source cannot follow them; cite docs/ instead
OUTSIDE_FILES = re.compile(r"\b(?:DESIGN|ALGORITHMS|ENVIRONMENT|COSTS)\b|\.\./shared")
SOURCE_DIRS = ("flowrl", "rewards", "samplers", "scripts")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]*(?:\([^()\s]*\)[^()\s>]*)*)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)"
)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SKIP_SCHEMES = ("http://", "https://", "mailto:")
# a page cited by its path from the repository root in a comment or docstring, as in `docs/recipes/grpo.md#kl`
MD_CITATION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)(?:#([\w%-]+))?")
CITING_DIRS = ("configs", "scripts")  # folders whose comments (and, in Python, docstrings) cite the docs
YAML_COMMENT = re.compile(r"(?:^|\s)#(.*)$")  # a '#' at the start of a line or after a space (shell scripts alike)


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "rewards" / "README.md"]


def _outside_fences(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markdown links and emphasis reduced to their text, lower case,
    punctuation removed except hyphens and underscores, each space a hyphen; unicode letters and digits kept."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).lower()  # inline HTML tags
    kept = []
    for ch in text:
        category = unicodedata.category(ch)
        if ch in "-_" or category[0] in "LN" or category == "Mn":
            kept.append(ch)
        elif ch == " ":
            kept.append("-")
    return "".join(kept)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in _outside_fences(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if target and not target.lower().startswith(SKIP_SCHEMES):
                links.append((number, target))
    return links


def broken_link(source: Path, target: str) -> str | None:
    """Why `target` (as written in `source`) does not resolve, or None."""
    file_part, _, anchor = target.partition("#")
    resolved = (source.parent / file_part).resolve() if file_part else source
    if REPO not in resolved.parents and resolved != REPO:
        return f"{file_part} leaves the repository"
    if not resolved.exists():
        return f"{file_part} does not exist"
    if anchor and resolved.suffix == ".md":
        if anchor not in anchors(resolved):
            return f"{resolved.relative_to(REPO)} has no heading with anchor #{anchor}"
    return None


def python_prose(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of every docstring of a Python file."""
    out = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return sorted(out)


def comment_prose(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment of a YAML or shell file."""
    return [(n, match.group(1)) for n, line in enumerate(text.splitlines(), 1) if (match := YAML_COMMENT.search(line))]


PROSE_READERS = {".py": python_prose, ".yaml": comment_prose, ".yml": comment_prose, ".sh": comment_prose}


def cited_pages(path: Path) -> list[tuple[int, str, Path]]:
    """(line number, target as written, the folder it is resolved from) of every page the comments (and docstrings)
    of `path` cite: a markdown link `[text](target)` resolves from the file's folder, a bare `x/y.md#anchor` from
    the repository root."""
    out = []
    for number, prose in PROSE_READERS[path.suffix](path.read_text(encoding="utf-8")):
        for match in LINK.finditer(prose):
            target = match.group(1)
            if target and not target.lower().startswith(SKIP_SCHEMES):
                out.append((number, target, path.parent))
        for match in MD_CITATION.finditer(LINK.sub("", prose)):
            out.append((number, match.group(0), REPO))
    return out


def broken_citation(target: str, base: Path) -> str | None:
    """Why `target`, resolved from the folder `base`, names no file (or no heading of that page), or None."""
    return broken_link(base / "citing-file", target) if target.partition("#")[0] else f"{target} names no file"


def citing_files(folder: str) -> list[Path]:
    return [p for p in sorted((REPO / folder).rglob("*")) if p.is_file() and p.suffix in PROSE_READERS]


def test_slug_follows_github():
    assert slug("Sigma-time convention") == "sigma-time-convention"
    assert slug("Sum then normalise: `weighted_sum`") == "sum-then-normalise-weighted_sum"
    assert slug("Porting from flow_grpo and DanceGRPO") == "porting-from-flow_grpo-and-dancegrpo"
    assert (
        slug("MARBLE: balance the per-reward gradients (`marble`)") == "marble-balance-the-per-reward-gradients-marble"
    )
    assert slug("Why Sol-RL cannot halve NFT's seconds") == "why-sol-rl-cannot-halve-nfts-seconds"
    assert slug("The σ grid — and more") == "the-σ-grid--and-more"
    assert slug("See [the math](math.md)") == "see-the-math"


def test_duplicate_headings_get_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n## Setup\n\n```\n## Setup\n```\n\n## Setup\n\n## Setup\n", encoding="utf-8")
    assert anchors(page) == {"results", "setup", "setup-1", "setup-2"}


def test_links_skip_code_and_urls(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[a](b.md) and `[c](d.md)` and [e](https://x.org/f.md) ![g](h.png)\n```\n[i](j.md)\n```\n[k](#l)\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(1, "b.md"), (1, "h.png"), (5, "#l")]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = [
        f"{path.relative_to(REPO)}:{n}: [..]({t}): {why}"
        for n, t in relative_links(path)
        if (why := broken_link(path, t))
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_linked_files_are_not_ignored_by_git():
    """A linked file that .gitignore hides exists here but not on a clean checkout (JSON of record, plots)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing can be ignored")
    targets = sorted(
        {
            str((path.parent / t.partition("#")[0]).resolve().relative_to(REPO))
            for path in markdown_files()
            for _, t in relative_links(path)
            if t.partition("#")[0] and not broken_link(path, t)
        }
    )
    found = subprocess.run(["git", "check-ignore", *targets], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert not found, f"linked files that git ignores (add a !pattern to .gitignore): {found}"


def test_readme_is_a_manual_of_at_most_16kb():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/ (at most {README_MAX_BYTES})"


def test_outside_files_pattern():
    for text in ("see DESIGN.md", "(ALGORITHMS §4.4)", "ENVIRONMENT.md", "COSTS.md", "../shared/notes.md"):
        assert OUTSIDE_FILES.search(text), text
    for text in ("docs/math.md#precision", "design", "COST_MODEL", "shared prefixes"):
        assert not OUTSIDE_FILES.search(text), text


def test_sources_name_no_file_outside_the_repository():
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                found += [
                    f"{path.relative_to(REPO)}:{number}: names {m.group(0)}" for m in OUTSIDE_FILES.finditer(line)
                ]
    assert not found, "files outside the repository named in source (cite docs/ instead):\n" + "\n".join(found)


def test_docs_name_no_file_outside_the_repository():
    found = [
        f"{path.relative_to(REPO)}:{number}: names {m.group(0)}"
        for path in markdown_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for m in OUTSIDE_FILES.finditer(line)
    ]
    assert not found, "files outside the repository named in the docs:\n" + "\n".join(found)


def test_cited_pages_come_from_comments_and_docstrings_only(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "# see docs/recipes/grpo.md#kl and [the math](../docs/math.md#sde-steps)\n"
        "key: docs/not_a_comment.md  # docs/toy.md\n"
        'url: "http://x.org/a#b"\n',
        encoding="utf-8",
    )
    assert [(n, t, base == REPO) for n, t, base in cited_pages(config)] == [
        (1, "../docs/math.md#sde-steps", False),
        (1, "docs/recipes/grpo.md#kl", True),
        (2, "docs/toy.md", True),
    ]
    script = tmp_path / "make.py"
    script.write_text(
        '"""Module docstring citing\ndocs/toy.md#judges on its second line."""\n\n'
        "NOTE = 'docs/in_a_string.md'  # docs/gpu.md\n\n\n"
        "def f():\n"
        '    """docs/cost.md#pricing"""\n'
        "    return 'docs/also_a_string.md'\n",
        encoding="utf-8",
    )
    assert [(n, t) for n, t, _ in cited_pages(script)] == [
        (2, "docs/toy.md#judges"),
        (4, "docs/gpu.md"),
        (8, "docs/cost.md#pricing"),
    ]


def test_broken_citations_are_named():
    assert broken_citation("docs/recipes/grpo.md#tree-rollouts", REPO) is None
    assert broken_citation("docs/recipes/grpo.md#no-such-heading", REPO) == (
        "docs/recipes/grpo.md has no heading with anchor #no-such-heading"
    )
    assert broken_citation("docs/no_such_page.md", REPO) == "docs/no_such_page.md does not exist"
    assert broken_citation("../docs/toy.md#judges", REPO / "configs") is None


@pytest.mark.parametrize("folder", CITING_DIRS)
def test_pages_cited_in_configs_and_scripts_resolve(folder):
    broken = [
        f"{path.relative_to(REPO)}:{n}: {target}: {why}"
        for path in citing_files(folder)
        for n, target, base in cited_pages(path)
        if (why := broken_citation(target, base))
    ]
    assert citing_files(folder), f"no file in {folder}/ to check"
    assert not broken, f"broken citations in {folder}/:\n" + "\n".join(broken)
