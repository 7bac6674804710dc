"""The real prompt sets: GenEval's metadata made by flowrl's own generator, and the OCR, PickScore and DrawBench
prompts read through `datasets`.

records = prompt_set_records("geneval:test")   # GenEval's 553 evaluation prompts (seed 43, its published file)
records = prompt_set_records("geneval:train")  # 50,000 training prompts that share none with them
prompts, metadata = load_prompt_set("drawbench", where="data")  # needs network once, or `source=` a local copy
write_records(records, "geneval_test.jsonl")   # the JSONL a config's `data.prompts_file` reads

A record is one JSON object, `{"prompt": ..., **metadata}`. GenEval's records carry `tag` (the task), `include`
[{class, count, color?, position?}] and `exclude` [{class, count}] exactly as GenEval's evaluation reads them: every
`include` clause must hold (at least `count` detections of `class`, the first `count` of them of `color`, each
`position` of the detections of the include clause it indexes), and no `exclude` clause may (fewer than `count`).

GenEval's rules, as its paper and prompt script publish them, over the 80 COCO classes and 10 colours:
- single_object: every class once, "a photo of a bench";
- two_object: two distinct classes, "a photo of a bench and a sports ball";
- counting: one class and a count of 2 to 4, "a photo of three clocks", which also excludes one more;
- colors: a class other than person and a colour, "a photo of a blue car";
- position: two distinct classes and one of four relations, "a photo of a dog right of a teddy bear" (the
  reference object first in `include`, the placed one second with `position: [relation, 0]`);
- color_attr: two distinct classes other than person with two distinct colours, "a photo of a pink car and a black
  dog".
"an" goes before a word that starts with a vowel letter, "a" before any other; a plural adds "es" after a final "s"
and "s" otherwise ("buses", "clocks"); counts are written as words.

The test split replays GenEval's draws with numpy's `default_rng(seed)`: the 80 single objects in a random order,
then 100 draws of each other task in the order above, exact repeats dropped. With seed 43 that is GenEval's published
evaluation_metadata.jsonl byte for byte (80, 99, 80, 94, 100 and 100 prompts per task, 553 in all); another seed
keeps that mix by trimming a task's extra prompts or drawing more. The train split draws from each task's whole space
(uniformly, as GenEval's draws are) minus every prompt that names the same thing as a test prompt: "A and B" is "B and
A" (Flow-GRPO's rule for its train split), "A left of B" is "B right of A". Its tasks keep the test's mix; single
objects are all in the test, so the train split has none, and a task whose remaining space is smaller than its share
repeats its prompts evenly. Its default size, 50,000, is the total of Flow-GRPO's GenEval merge script
(dataset/merge_genevaltask.py).

OCR and PickScore are Flow-GRPO's own prompt files (its dataset/ folder, at a fixed commit), DrawBench the hub copy
`sayakpaul/drawbench` of its 200 prompts; all three load through `datasets` (the extra `datasets`), which caches them,
so a machine that read a set once reads it offline. Offline and uncached, a one-line error says what to do.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
"""The 80 COCO classes in GenEval's order (its object_names.txt; the detector's label order)."""
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
GENEVAL_POSITIONS = ("left of", "right of", "above", "below")
GENEVAL_COUNTS = (2, 3, 4)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
GENEVAL_TEST_MIX = {
    "single_object": 80,
    "two_object": 99,
    "counting": 80,
    "colors": 94,
    "position": 100,
    "color_attr": 100,
}
"""Prompts per task in GenEval's evaluation_metadata.jsonl (553 in all), in its order."""
GENEVAL_SEED = 43
"""The seed of GenEval's published prompts."""
GENEVAL_TRAIN_SIZE = 50_000
"""Training prompts by default: the total of Flow-GRPO's GenEval merge script."""
GENEVAL_DRAWS_PER_TASK = 100

_PERSON = COCO_CLASSES.index("person")
_COLORABLE = COCO_CLASSES[_PERSON + 1 :] + COCO_CLASSES[:_PERSON]  # GenEval's colour tasks skip person
_MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

# 1. GenEval's grammar and records


def with_article(word: str) -> str:
    """GenEval's article: "an" before a vowel letter, "a" otherwise ("an orange", "a hair drier")."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def plural(name: str) -> str:
    """GenEval's plural: "es" after a final "s", "s" otherwise ("buses", "wine glasses", "clocks")."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


def geneval_record(tag: str, params: tuple) -> dict[str, Any]:
    """The record of one GenEval prompt. params: single_object (class,), two_object (a, b), counting (class, n),
    colors (class, colour), position (a, relation, b) for "a photo of a <a> <relation> a <b>", color_attr
    (colour_a, a, colour_b, b)."""
    if tag == "single_object":
        (name,) = params
        return {"tag": tag, "include": [{"class": name, "count": 1}], "prompt": f"a photo of {with_article(name)}"}
    if tag == "two_object":
        a, b = params
        include = [{"class": a, "count": 1}, {"class": b, "count": 1}]
        return {"tag": tag, "include": include, "prompt": f"a photo of {with_article(a)} and {with_article(b)}"}
    if tag == "counting":
        name, n = params
        return {
            "tag": tag,
            "include": [{"class": name, "count": n}],
            "exclude": [{"class": name, "count": n + 1}],
            "prompt": f"a photo of {NUMBER_WORDS[n]} {plural(name)}",
        }
    if tag == "colors":
        name, color = params
        include = [{"class": name, "count": 1, "color": color}]
        return {"tag": tag, "include": include, "prompt": f"a photo of {with_article(color)} {name}"}
    if tag == "position":
        a, relation, b = params
        include = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}]
        return {"tag": tag, "include": include, "prompt": f"a photo of {with_article(a)} {relation} {with_article(b)}"}
    if tag == "color_attr":
        color_a, a, color_b, b = params
        include = [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1, "color": color_b}]
        prompt = f"a photo of {with_article(color_a)} {a} and {with_article(color_b)} {b}"
        return {"tag": tag, "include": include, "prompt": prompt}
    raise ValueError(f"GenEval tag={tag!r} is not a GenEval task; use one of {', '.join(GENEVAL_TEST_MIX)}")


def check_geneval_record(record: dict, where: str = "record") -> tuple[str, tuple]:
    """(tag, params) of a GenEval record, checked against GenEval's rules: the task's clause shape, classes among
    the 80 COCO names, counts 1 (2 to 4 when counting, with an exclude of one more), colours and relations from
    GenEval's lists, and the prompt its template writes. A one-line error names the field otherwise."""
    tag = record.get("tag")
    if tag not in GENEVAL_TEST_MIX:
        raise ValueError(f"{where}: tag={tag!r} is not a GenEval task; use one of {', '.join(GENEVAL_TEST_MIX)}")
    include = record.get("include")
    size = 2 if tag in ("two_object", "position", "color_attr") else 1
    if not isinstance(include, list) or len(include) != size or not all(isinstance(c, dict) for c in include):
        raise ValueError(f"{where}: include={include!r} must be a list of {size} clause(s) for tag {tag!r}")
    for clause in include:
        if clause.get("class") not in COCO_CLASSES:
            raise ValueError(f"{where}: class={clause.get('class')!r} is not a COCO class; use one of GenEval's 80")
        if "color" in clause and clause["color"] not in GENEVAL_COLORS:
            raise ValueError(f"{where}: color={clause['color']!r} is not a GenEval colour; use one of {GENEVAL_COLORS}")
    counts = [c.get("count") for c in include]
    if tag == "counting":
        n = counts[0]
        if n not in GENEVAL_COUNTS or record.get("exclude") != [{"class": include[0]["class"], "count": n + 1}]:
            raise ValueError(f"{where}: a counting record needs count in {GENEVAL_COUNTS} and exclude of count + 1")
    elif counts != [1] * size or "exclude" in record:
        raise ValueError(f"{where}: count={counts} must be 1 (and no exclude) for tag {tag!r}")
    names = [c["class"] for c in include]
    colors = [c.get("color") for c in include]
    if tag == "position":
        relation = include[1].get("position")
        if not isinstance(relation, list | tuple) or len(relation) != 2 or relation[1] != 0:
            raise ValueError(f"{where}: position={relation!r} must be [relation, 0] on the second include clause")
        if relation[0] not in GENEVAL_POSITIONS:
            raise ValueError(f"{where}: position={relation[0]!r} is not a GenEval relation; use {GENEVAL_POSITIONS}")
        params = (names[1], relation[0], names[0])
    elif tag == "color_attr":
        params = (colors[0], names[0], colors[1], names[1])
    elif tag == "colors":
        params = (names[0], colors[0])
    elif tag == "counting":
        params = (names[0], counts[0])
    else:
        params = tuple(names)
    expected = geneval_record(tag, params)
    if record != expected:
        raise ValueError(f"{where}: {record!r} is not GenEval's record for {params}; GenEval writes {expected!r}")
    return tag, params


def geneval_key(tag: str, params: tuple) -> tuple:
    """What a prompt asks for, the same for prompts that differ only in order: "A and B" = "B and A", "A left of B" =
    "B right of A"; two prompts with one key never sit on both sides of the train/test split."""
    if tag == "two_object":
        return tag, frozenset(params)
    if tag == "position":
        a, relation, b = params
        return (tag, b, _MIRROR[relation], a) if relation in ("right of", "below") else (tag, a, relation, b)
    if tag == "color_attr":
        color_a, a, color_b, b = params
        return tag, frozenset(((color_a, a), (color_b, b)))
    return (tag, *params)


# 2. The test split: GenEval's draws


def _draw(tag: str, rng: np.random.Generator) -> tuple:
    """One GenEval draw of a task (its numpy calls in its order, so a seed gives GenEval's own prompts)."""
    n = len(COCO_CLASSES)
    if tag == "two_object":
        a, b = rng.choice(n, size=2, replace=False)
        return COCO_CLASSES[a], COCO_CLASSES[b]
    if tag == "counting":
        name = COCO_CLASSES[rng.choice(n)]
        return name, int(rng.integers(GENEVAL_COUNTS[0], GENEVAL_COUNTS[-1], endpoint=True))
    if tag == "colors":
        name = _COLORABLE[rng.choice(len(_COLORABLE))]
        return name, GENEVAL_COLORS[rng.choice(len(GENEVAL_COLORS))]
    if tag == "position":
        a, b = rng.choice(n, size=2, replace=False)
        return COCO_CLASSES[a], GENEVAL_POSITIONS[rng.choice(len(GENEVAL_POSITIONS))], COCO_CLASSES[b]
    a, b = rng.choice(len(_COLORABLE), size=2, replace=False)  # color_attr
    color_a, color_b = rng.choice(len(GENEVAL_COLORS), size=2, replace=False)
    return GENEVAL_COLORS[color_a], _COLORABLE[a], GENEVAL_COLORS[color_b], _COLORABLE[b]


def geneval_test(seed: int = GENEVAL_SEED) -> list[dict[str, Any]]:
    """GenEval's evaluation records for `seed` (seed 43: its published 553), GENEVAL_TEST_MIX prompts per task."""
    rng = np.random.default_rng(seed)
    n = len(COCO_CLASSES)
    drawn = {"single_object": [(COCO_CLASSES[i],) for i in rng.choice(n, size=n, replace=False)]}
    for tag in list(GENEVAL_TEST_MIX)[1:]:
        drawn[tag] = [_draw(tag, rng) for _ in range(GENEVAL_DRAWS_PER_TASK)]
    records = []
    for tag, quota in GENEVAL_TEST_MIX.items():
        unique = list(dict.fromkeys(drawn[tag]))[:quota]  # first occurrences in draw order
        while len(unique) < quota:  # another seed: top up after all of GenEval's draws
            params = _draw(tag, rng)
            if params not in unique:
                unique.append(params)
        records += [geneval_record(tag, params) for params in unique]
    return records


# 3. The train split: each task's whole space minus the test's keys


def _distinct_pair(i: int, n: int) -> tuple[int, int]:
    """The i-th ordered pair (a, b) of distinct indices below n."""
    a, r = divmod(i, n - 1)
    return a, r + (r >= a)


def _space(tag: str) -> tuple[int, int]:
    """(prompts in the task's space, index items per key): every distinct prompt GenEval's rules can write."""
    n, m, c, p = len(COCO_CLASSES), len(_COLORABLE), len(GENEVAL_COLORS), len(GENEVAL_POSITIONS)
    return {
        "single_object": (n, 1),
        "two_object": (n * (n - 1), 2),
        "counting": (n * len(GENEVAL_COUNTS), 1),
        "colors": (m * c, 1),
        "position": (n * (n - 1) * p, 2),
        "color_attr": (m * (m - 1) * c * (c - 1), 2),
    }[tag]


def _decode(tag: str, i: int) -> tuple:
    """The params of the i-th prompt of a task's space."""
    if tag == "single_object":
        return (COCO_CLASSES[i],)
    if tag == "two_object":
        a, b = _distinct_pair(i, len(COCO_CLASSES))
        return COCO_CLASSES[a], COCO_CLASSES[b]
    if tag == "counting":
        name, k = divmod(i, len(GENEVAL_COUNTS))
        return COCO_CLASSES[name], GENEVAL_COUNTS[k]
    if tag == "colors":
        name, color = divmod(i, len(GENEVAL_COLORS))
        return _COLORABLE[name], GENEVAL_COLORS[color]
    if tag == "position":
        pair, relation = divmod(i, len(GENEVAL_POSITIONS))
        a, b = _distinct_pair(pair, len(COCO_CLASSES))
        return COCO_CLASSES[a], GENEVAL_POSITIONS[relation], COCO_CLASSES[b]
    pair, colors = divmod(i, len(GENEVAL_COLORS) * (len(GENEVAL_COLORS) - 1))  # color_attr
    a, b = _distinct_pair(pair, len(_COLORABLE))
    color_a, color_b = _distinct_pair(colors, len(GENEVAL_COLORS))
    return GENEVAL_COLORS[color_a], _COLORABLE[a], GENEVAL_COLORS[color_b], _COLORABLE[b]


def _shares(weights: dict[str, int], total: int) -> dict[str, int]:
    """`total` split in proportion to `weights` by largest remainders (ties to the earlier task)."""
    whole = sum(weights.values())
    shares = {tag: total * w // whole for tag, w in weights.items()}
    by_remainder = sorted(weights, key=lambda tag: -(total * weights[tag] % whole))  # sorted() is stable
    for tag in by_remainder[: total - sum(shares.values())]:
        shares[tag] += 1
    return shares


def geneval_train(
    seed: int = GENEVAL_SEED, num_prompts: int = GENEVAL_TRAIN_SIZE, test: list[dict] | None = None
) -> list[dict[str, Any]]:
    """`num_prompts` training records, none with the key of a test record (default: geneval_test(seed)), the
    tasks in the test's mix over those with room left, shuffled with a stream of `seed` apart from the test's."""
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r} must be a positive integer (GenEval train prompts)")
    test = geneval_test(seed) if test is None else test
    excluded = {geneval_key(*check_geneval_record(r, f"test record {i}")) for i, r in enumerate(test)}
    room = {tag: _space(tag)[0] - _space(tag)[1] * sum(key[0] == tag for key in excluded) for tag in GENEVAL_TEST_MIX}
    shares = _shares({tag: w for tag, w in GENEVAL_TEST_MIX.items() if room[tag] > 0}, num_prompts)
    rng = np.random.default_rng([seed, 1])
    records = []
    for tag, share in shares.items():
        chosen = []
        for i in rng.permutation(_space(tag)[0]):
            params = _decode(tag, int(i))
            if geneval_key(tag, params) not in excluded:
                chosen.append(params)
                if len(chosen) == share:
                    break
        records += [geneval_record(tag, chosen[j % len(chosen)]) for j in range(share)]  # even repeats if short
    return [records[i] for i in rng.permutation(len(records))]


# 4. The sets read through `datasets`

_FLOWGRPO_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"
_FLOWGRPO_FILE = "https://raw.githubusercontent.com/yifan123/flow_grpo/{commit}/dataset/{folder}/{split}.txt"


class PromptSetUnavailable(ConnectionError):
    """A prompt set's source cannot be read (offline and not cached, or unreachable); the message says what to do."""


@dataclass(frozen=True)
class HubSet:
    """Where a prompt set lives and how its rows become records."""

    about: str
    path: str
    """`datasets.load_dataset`'s first argument: a hub dataset id, or a builder ("text") reading `data_files`."""
    splits: dict[str, str]
    """flowrl's split (train, test) -> the dataset's split name."""
    column: str
    """The prompt column."""
    data_files: dict[str, str] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    """Record key -> column, kept beside the prompt as metadata."""

    def source(self, split: str) -> str:
        return self.data_files.get(split, self.path)


def _flowgrpo(folder: str) -> dict[str, str]:
    return {s: _FLOWGRPO_FILE.format(commit=_FLOWGRPO_COMMIT, folder=folder, split=s) for s in ("train", "test")}


HUB_SETS = {
    "ocr": HubSet(
        about="Flow-GRPO's text-rendering prompts (scenes with quoted text; dataset/ocr of yifan123/flow_grpo)",
        path="text",
        splits={"train": "train", "test": "test"},
        column="text",
        data_files=_flowgrpo("ocr"),
    ),
    "pickscore": HubSet(
        about="Flow-GRPO's Pick-a-Pic prompts (unique yuvalkirstain/pickapic_v1 captions of six words or more, "
        "2,048 held out for test; dataset/pickscore of yifan123/flow_grpo)",
        path="text",
        splits={"train": "train", "test": "test"},
        column="text",
        data_files=_flowgrpo("pickscore"),
    ),
    "drawbench": HubSet(
        about="DrawBench's 200 prompts in 11 categories (Imagen's benchmark; the hub copy sayakpaul/drawbench)",
        path="sayakpaul/drawbench",
        splits={"test": "train"},
        column="Prompts",
        extra={"category": "Category"},
    ),
}
PROMPT_SETS = ("geneval", *HUB_SETS)


def _offline() -> bool:
    flags = (os.environ.get(v, "").strip().lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


def _datasets(name: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"prompt set {name!r} is read through the `datasets` package; pip install datasets") from None
    return datasets


def _load_table(name: str, split: str, source: str | Path | None):
    """The split's `datasets.Dataset`: from the hub or a URL (cached by `datasets`), or from `source`, a local copy
    read in memory: a `save_to_disk` folder (a Dataset, or a DatasetDict with the split), a .txt (one prompt a line),
    a .jsonl (records), or the .csv / .parquet file of a hub dataset's repository."""
    spec, datasets = HUB_SETS[name], _datasets(name)
    if source is not None:
        path = Path(source)
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
            if isinstance(table, datasets.DatasetDict):
                for key in (split, spec.splits[split]):
                    if key in table:
                        return table[key]
                raise ValueError(f"source={str(path)!r} holds splits {sorted(table)}, not {split!r}; save that split")
            return table
        kinds = (".txt", ".jsonl", ".csv", ".parquet")
        if not path.is_file() or path.suffix not in kinds:
            raise FileNotFoundError(
                f"source={str(path)!r} is not a save_to_disk folder or a {'/'.join(kinds)} file; give a local copy"
            )
        text = path.read_text(encoding="utf-8") if path.suffix in (".txt", ".jsonl") else ""
        if path.suffix == ".txt":  # one prompt a line, # comments, as a config's prompts_file
            lines = [t for t in text.splitlines() if t.strip() and not t.lstrip().startswith("#")]
            return datasets.Dataset.from_dict({"text": lines})
        if path.suffix == ".jsonl":  # one record a line, as `flowrl prompts` writes them
            return datasets.Dataset.from_list([json.loads(t) for t in text.splitlines() if t.strip()])
        import pandas

        frame = pandas.read_csv(path) if path.suffix == ".csv" else pandas.read_parquet(path)
        return datasets.Dataset.from_pandas(frame, preserve_index=False)
    where = spec.source(split)
    kwargs = {"data_files": {spec.splits[split]: where}} if spec.data_files else {}
    try:
        return datasets.load_dataset(spec.path, split=spec.splits[split], **kwargs)
    except OSError as err:
        reason = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if _offline() else "it could not be reached"
        raise PromptSetUnavailable(
            f"prompt set {name}:{split} reads {where} through `datasets`, and {reason} and no cached copy exists "
            f"({type(err).__name__}); run once with network access (HF_HUB_OFFLINE unset) to cache it, or give a "
            f"local copy (source=/--source: a save_to_disk folder or a text file with one prompt a line)"
        ) from None


def table_records(name: str, table) -> list[dict[str, Any]]:
    """Records of a `datasets.Dataset` of a set: its prompt column (or `prompt` / `text` in a local copy), whitespace
    collapsed, blank rows dropped, and the set's extra columns (or their record keys, in a copy flowrl wrote) as
    metadata."""
    spec = HUB_SETS[name]
    columns = list(table.column_names)
    column = next((c for c in (spec.column, "prompt", "text") if c in columns), None)
    if column is None:
        raise ValueError(f"prompt set {name!r}: no prompt column {spec.column!r} among {columns}; rename the column")
    extra = {key: table[col] for key, col in spec.extra.items() for col in (col, key) if col in columns}
    records = []
    for row, text in enumerate(table[column]):
        prompt = " ".join(str(text or "").split())
        if prompt:
            records.append({"prompt": prompt, **{key: values[row] for key, values in extra.items()}})
    if not records:
        raise ValueError(f"prompt set {name!r}: column {column!r} holds no prompt; check the source")
    return records


# 5. Sets by name, and files


def parse_prompt_set(spec: str) -> tuple[str, str]:
    """'geneval:train' -> ('geneval', 'train'); a bare name means its test split (the benchmark)."""
    name, _, split = spec.partition(":")
    split = split or "test"
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set {spec!r}: unknown set {name!r}; use one of {', '.join(PROMPT_SETS)}")
    splits = ("train", "test") if name == "geneval" else tuple(HUB_SETS[name].splits)
    if split not in splits:
        choices = " or ".join(f"{name}:{s}" for s in splits)
        raise ValueError(f"prompt set {spec!r}: {name} has no split {split!r}; use {choices}")
    return name, split


def prompt_set_records(
    spec: str, seed: int | None = None, num_prompts: int | None = None, source: str | Path | None = None
) -> list[dict[str, Any]]:
    """The records of a set named 'name' or 'name:split' (geneval, ocr, pickscore, drawbench; train or test).
    `seed` and `num_prompts` (train only) shape GenEval's splits; the other sets are fixed files and take `source`,
    a local copy, instead of the network."""
    name, split = parse_prompt_set(spec)
    if name == "geneval":
        if source is not None:
            raise ValueError("geneval is generated by flowrl; it takes no source (drop --source)")
        if num_prompts is not None and split == "test":
            raise ValueError("geneval:test is GenEval's fixed mix of 553 prompts; num_prompts applies to geneval:train")
        seed = GENEVAL_SEED if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer (GenEval's own prompts: {GENEVAL_SEED})")
        return geneval_test(seed) if split == "test" else geneval_train(seed, num_prompts or GENEVAL_TRAIN_SIZE)
    if seed is not None or num_prompts is not None:
        raise ValueError(f"{name}'s splits are fixed prompt files; seed and num_prompts apply to geneval only")
    return table_records(name, _load_table(name, split, source))


def load_prompt_set(spec: str, where: str = "data", seed: int | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """(prompts [P], metadata [P]) of a named set, as training/prompts.load_prompt_records returns a file's:
    each record's keys other than `prompt` are its metadata (GenEval's tag, include, exclude)."""
    try:
        records = prompt_set_records(spec, seed=seed)
    except (ValueError, PromptSetUnavailable) as err:
        raise type(err)(f"{where}.prompt_set: {err}") from None
    return [r["prompt"] for r in records], [{k: v for k, v in r.items() if k != "prompt"} for r in records]


def task_counts(records: list[dict]) -> dict[str, int]:
    """Records per GenEval task (`tag`), in GenEval's order; {} for sets without tags."""
    counts = Counter(r["tag"] for r in records if "tag" in r)
    return {tag: counts[tag] for tag in GENEVAL_TEST_MIX if tag in counts}


def write_records(records: list[dict], out: str | Path, header: str | None = None) -> Path:
    """Write records as JSONL (`.jsonl`: one object a line, GenEval's key order) or as text (`.txt`: one prompt a
    line after `header` as # comments; only for sets without metadata besides the prompt)."""
    path = Path(out)
    if path.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"--out {str(path)!r} must end in .jsonl (records) or .txt (one prompt a line)")
    if path.suffix == ".txt":
        if any("tag" in r for r in records):
            raise ValueError(f"--out {str(path)!r}: GenEval records need their metadata; write a .jsonl file")
        comments = [r["prompt"] for r in records if r["prompt"].startswith("#")]
        if comments:
            raise ValueError(f"--out {str(path)!r}: {len(comments)} prompt(s) start with '#' (comments); write .jsonl")
        lines = [f"# {line}" for line in (header or "").splitlines()] + [r["prompt"] for r in records]
    else:
        lines = [json.dumps(r) for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
