"""GenEval's metadata from flowrl's generator, checked against GenEval's own published prompts and rules.

geneval_published_sample.jsonl holds 30 lines of GenEval's evaluation_metadata.jsonl (djghosh13/geneval, prompts/,
commit af4902f, unchanged since d927da8), chosen for its grammar: "an" before vowels, "a hair drier", plurals in "es",
the three number words, all four relations, an orange orange. PUBLISHED_SHA256 is the SHA-256 of that whole file
(553 lines), so the seed-43 test split is compared with all of it byte for byte. The rules the schema test applies
are GenEval's, read from its prompts/create_prompts.py and evaluation/evaluate_images.py and written out here.
"""

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from flowrl import prompt_sets as ps

HERE = Path(__file__).parent
PUBLISHED_SHA256 = "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13"
PUBLISHED_MIX = {
    "single_object": 80,
    "two_object": 99,
    "counting": 80,
    "colors": 94,
    "position": 100,
    "color_attr": 100,
}
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]  # evaluate_images.py
RELATIONS = {"left of", "right of", "above", "below"}  # the relations relative_position() can return
NUMBER = {2: "two", 3: "three", 4: "four"}
MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def article(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def jsonl_bytes(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def test43():
    return ps.geneval_test(43)


@pytest.fixture(scope="module")
def train43():
    return ps.geneval_train(43)


def test_seed_43_is_genevals_published_file_byte_for_byte(test43):
    assert hashlib.sha256(jsonl_bytes(test43)).hexdigest() == PUBLISHED_SHA256
    # The 80 single objects are all of GenEval's class names, so the class list is GenEval's too.
    assert {r["include"][0]["class"] for r in test43 if r["tag"] == "single_object"} == set(ps.COCO_CLASSES)


def test_grammar_matches_genevals_published_prompts_for_the_same_tuples():
    published = [json.loads(line) for line in (HERE / "geneval_published_sample.jsonl").read_text().splitlines()]
    assert len(published) == 30 and len({r["tag"] for r in published}) == 6
    for record in published:
        inc = record["include"]
        names, colors = [c["class"] for c in inc], [c.get("color") for c in inc]
        params = {
            "single_object": lambda: (names[0],),
            "two_object": lambda: (names[0], names[1]),
            "counting": lambda: (names[0], inc[0]["count"]),
            "colors": lambda: (names[0], colors[0]),
            "position": lambda: (names[1], inc[1]["position"][0], names[0]),
            "color_attr": lambda: (colors[0], names[0], colors[1], names[1]),
        }[record["tag"]]()
        assert ps.geneval_record(record["tag"], params) == record, record["prompt"]
    prompts = " | ".join(r["prompt"] for r in published)
    for phrase in ("an orange orange", "an umbrella", "a hair drier", "three buses", "three wine glasses", "four "):
        assert phrase in prompts  # the sample holds the grammar's edge cases


@pytest.mark.parametrize("seed", [43, 0, 7, 2024])
def test_test_split_has_genevals_task_mix(seed):
    records = ps.geneval_test(seed)
    counts = Counter(r["tag"] for r in records)
    assert dict(counts) == PUBLISHED_MIX and len(records) == 553
    assert len({r["prompt"] for r in records}) == 553
    assert list(dict.fromkeys(r["tag"] for r in records)) == list(PUBLISHED_MIX)  # GenEval's task order


def check_by_genevals_rules(record):
    """GenEval's rules, written out independently of flowrl's validator."""
    tag, inc = record["tag"], record["include"]
    keys = {"tag", "include", "prompt", "exclude"} if tag == "counting" else {"tag", "include", "prompt"}
    assert set(record) == keys
    assert json.loads(json.dumps(record)) == record  # JSON as GenEval's evaluation reads it
    for clause in inc:
        assert set(clause) <= {"class", "count", "color", "position"}
        assert clause["class"] in ps.COCO_CLASSES
        assert clause.get("color", "red") in COLORS
    names = [c["class"] for c in inc]
    if tag == "counting":
        n = inc[0]["count"]
        assert 2 <= n <= 4 and record["exclude"] == [{"class": names[0], "count": n + 1}]
        assert record["prompt"] == f"a photo of {NUMBER[n]} {names[0]}{'es' if names[0][-1] == 's' else 's'}"
    else:
        assert [c["count"] for c in inc] == [1] * len(inc)
    if tag in ("two_object", "position", "color_attr"):
        assert len(inc) == 2 and names[0] != names[1]
    else:
        assert len(inc) == 1
    if tag in ("colors", "color_attr"):
        assert "person" not in names and all("color" in c for c in inc)
        assert len({c["color"] for c in inc}) == len(inc)
    if tag == "position":
        relation, target = inc[1]["position"]
        assert relation in RELATIONS and target == 0 and "position" not in inc[0]
        assert record["prompt"] == f"a photo of {article(names[1])} {relation} {article(names[0])}"
    if tag == "two_object":
        assert record["prompt"] == f"a photo of {article(names[0])} and {article(names[1])}"
    if tag == "color_attr":
        colors = [c["color"] for c in inc]
        assert record["prompt"] == f"a photo of {article(colors[0])} {names[0]} and {article(colors[1])} {names[1]}"


def test_every_record_is_readable_by_genevals_rules(test43, train43):
    for record in test43 + train43[::10]:
        check_by_genevals_rules(record)
        assert ps.check_geneval_record(record)[0] == record["tag"]  # flowrl's validator accepts what GenEval does


def order_free(record):
    """What a prompt asks for, with "A and B" = "B and A" and "A left of B" = "B right of A" (computed here)."""
    tag, inc = record["tag"], record["include"]
    clauses = tuple(sorted((c["class"], c.get("color", ""), c["count"]) for c in inc))
    if tag == "position":
        relation, (a, b) = inc[1]["position"][0], (inc[1]["class"], inc[0]["class"])
        return (tag, a, relation, b) if relation in ("left of", "above") else (tag, b, MIRROR[relation], a)
    return tag, clauses


def test_train_shares_no_prompt_nor_an_order_variant_with_test(test43, train43):
    assert not {r["prompt"] for r in train43} & {r["prompt"] for r in test43}
    assert not {order_free(r) for r in train43} & {order_free(r) for r in test43}
    # The swapped wordings of the test's prompts, written out as strings, are absent from the train split too.
    swapped = set()
    for r in test43:
        if r["tag"] == "two_object":
            swapped.add(re.sub(r"^a photo of (an? .+) and (an? .+)$", r"a photo of \2 and \1", r["prompt"]))
        if r["tag"] == "position":
            a, relation, b = r["include"][1]["class"], r["include"][1]["position"][0], r["include"][0]["class"]
            swapped.add(f"a photo of {article(b)} {MIRROR[relation]} {article(a)}")
    assert len(swapped) == 199 and not swapped & {r["prompt"] for r in train43}


def test_train_size_mix_and_even_repeats(train43):
    assert len(train43) == 50_000
    # The test's mix over the five tasks with room (every single object is a test prompt): 50,000 x w / 473 with the
    # three leftover prompts to the largest remainders (.82 position, .82 color_attr, .66 counting).
    expected = {"two_object": 10465, "counting": 8457, "colors": 9936, "position": 10571, "color_attr": 10571}
    assert Counter(r["tag"] for r in train43) == expected
    per_task = {tag: Counter(r["prompt"] for r in train43 if r["tag"] == tag) for tag in expected}
    # Spaces by hand: counting 80 classes x 3 counts - 80 test = 160; colors 79 x 10 - 94 = 696; two_object
    # 80 x 79 ordered pairs - 2 x 99 (both orders of each test pair) = 6122; the others have more room than prompts.
    assert len(per_task["counting"]) == 160 and set(per_task["counting"].values()) == {52, 53}
    assert len(per_task["colors"]) == 696 and set(per_task["colors"].values()) == {14, 15}
    assert len(per_task["two_object"]) == 6122 and set(per_task["two_object"].values()) == {1, 2}
    assert set(per_task["position"].values()) == set(per_task["color_attr"].values()) == {1}
    assert [r["tag"] for r in train43[:200]] != sorted(r["tag"] for r in train43[:200])  # shuffled, not by task


def test_same_seed_same_files_and_another_seed_another_split(tmp_path, train43):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ps.write_records(ps.geneval_train(43, 3000), first)
    ps.write_records(ps.geneval_train(43, 3000), second)
    assert first.read_bytes() == second.read_bytes()
    assert jsonl_bytes(ps.geneval_test(5)) == jsonl_bytes(ps.geneval_test(5))
    assert jsonl_bytes(ps.geneval_test(5)) != jsonl_bytes(ps.geneval_test(6))
    assert jsonl_bytes(ps.geneval_train(44, 3000)) != first.read_bytes()
    assert train43[:100] != ps.geneval_train(44)[:100]


def test_train_excludes_the_test_it_is_given_and_small_sizes():
    test = ps.geneval_test(3)
    train = ps.geneval_train(3, 12, test=test)
    assert len(train) == 12 and not {order_free(r) for r in train} & {order_free(r) for r in test}
    with pytest.raises(ValueError, match=r"num_prompts=0 must be a positive integer"):
        ps.geneval_train(3, 0)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"tag": "shapes", "include": [], "prompt": "x"}, r"tag='shapes' is not a GenEval task"),
        ({"tag": "colors", "include": [{"class": "unicorn", "count": 1}], "prompt": "x"}, r"class='unicorn'"),
        (
            {
                "tag": "colors",
                "include": [{"class": "car", "count": 1, "color": "teal"}],
                "prompt": "a photo of a teal car",
            },
            r"color='teal' is not a GenEval colour",
        ),
        ({"tag": "counting", "include": [{"class": "car", "count": 7}], "prompt": "x"}, r"count in \(2, 3, 4\)"),
        (
            {
                "tag": "position",
                "include": [{"class": "car", "count": 1}, {"class": "cat", "count": 1, "position": ["near", 0]}],
            },
            r"position='near' is not a GenEval relation",
        ),
        ({"tag": "single_object", "include": [{"class": "car", "count": 1}], "prompt": "a car"}, r"GenEval writes"),
    ],
)
def test_check_geneval_record_names_the_field(record, message):
    with pytest.raises(ValueError, match=message):
        ps.check_geneval_record(record, "line 3")
