"""The `geneval` reward (rewards/geneval.py) on tiny random-weight models built from configs: a Mask2Former in the
official checkpoint layout and a transformers CLIP. End to end against an independent path (the test's own forward,
its own post-processing in float64, GenEval's colour crop through torchvision, and GenEval's and flow_grpo's own
rule code from tests/fixtures/geneval_upstream/), the pieces by hand, the records, the errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowrl.registry import REWARDS
from flowrl.rewards import _geneval_rules as rules
from flowrl.rewards._tiny import tiny_geneval

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # built, never iterated
UPSTREAM = Path(__file__).resolve().parents[1] / "fixtures" / "geneval_upstream"
DETECTED = ("dog", "cat", "cup")  # the classes the biased tiny detector finds
RECORDS = [  # one per task, as GenEval writes them (`prompt` is for GenEval's own code; the reward reads the rest)
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}], "prompt": "p"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]},
    {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}], "prompt": "a photo of a red cup"},
    {
        "tag": "position",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
    },
    {
        "tag": "color_attr",
        "include": [{"class": "dog", "count": 1, "color": "blue"}, {"class": "cat", "count": 1, "color": "green"}],
    },
]
for record in RECORDS:
    record.setdefault("prompt", f"a photo for {record['tag']}")


def _upstream(name: str):
    spec = importlib.util.spec_from_file_location(f"geneval_upstream_{name}", UPSTREAM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 3, 40, 36] k/255 images: a coloured rectangle on noise (short_side 36, long_side 40: no resize)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 40, 36), generator=generator).float()
    for image in images:
        y, x = torch.randint(0, 30, (2,), generator=generator).tolist()
        image[:, y : y + 10, x : x + 8] = torch.randint(0, 256, (3, 1, 1), generator=generator).float()
    return images / 255


@pytest.fixture(scope="module")
def detecting(tmp_path_factory) -> dict:
    kwargs = tiny_geneval(tmp_path_factory.mktemp("geneval"), detect=True)
    return {**kwargs, "long_side": 40, "max_detections": 10}


# ---- end to end -------------------------------------------------------------------------------------------------


def _independent_detections(kwargs: dict, pixels: torch.Tensor) -> list[list[dict]]:
    """The test's own path from uint8 images to mmdet-style detections: the checkpoint read with transformers'
    Mask2FormerModel and a Linear head, mmdet's normalisation and padding, every (query, class) pair ranked in float64,
    its mask upsampled, scored and boxed in a loop."""
    from safetensors.torch import load_file
    from transformers import Mask2FormerModel

    model = Mask2FormerModel.from_pretrained(kwargs["detector_model"]).eval()
    head = load_file(str(Path(kwargs["detector_model"]) / "model.safetensors"))
    mean = torch.tensor([123.675, 116.28, 103.53]).view(1, 3, 1, 1)
    std = torch.tensor([58.395, 57.12, 57.375]).view(1, 3, 1, 1)
    inputs = F.pad((pixels.float() - mean) / std, (0, 64 - 36, 0, 64 - 40))  # 40 x 36 padded to 64 x 64
    with torch.no_grad():
        out = model(pixel_values=inputs, output_hidden_states=True)
        hidden = out.transformer_decoder_intermediate_states[-1].transpose(0, 1)
        class_logits = hidden @ head["class_predictor.weight"].T + head["class_predictor.bias"]
    found = []
    for logits, masks in zip(class_logits.double(), out.masks_queries_logits[-1].double()):
        probs = logits.softmax(-1)[:, :80]
        pairs = sorted(((float(probs[q, c]), q, c) for q in range(len(probs)) for c in range(80)), reverse=True)
        detections = []
        for prob, q, c in pairs[: kwargs["max_detections"]]:
            up = F.interpolate(masks[q][None, None], size=(64, 64), mode="bilinear", align_corners=False)
            up = up[0, 0, :40, :36]
            mask = (up > 0).numpy()
            score = prob * float((up.sigmoid() * (up > 0)).sum() / ((up > 0).sum() + 1e-6))
            ys, xs = np.nonzero(mask)
            box = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] if len(xs) else [0, 0, 0, 0]
            box = np.array(box, dtype=np.float32)
            detections.append({"label": c, "prob": prob, "score": score, "box": box, "mask": mask})
        found.append(detections)
    return found


def _independent_colour_logits(kwargs: dict):
    """(PIL image, class name, box, mask) -> colour logits, GenEval's way: Image.composite on "#999", crop, the
    torchvision transform open_clip builds, CLIP features against the mean of the three templates' embeddings."""
    from torchvision import transforms
    from transformers import CLIPModel, CLIPTokenizer

    clip = CLIPModel.from_pretrained(kwargs["clip_model"]).eval()
    tokenizer = CLIPTokenizer.from_pretrained(kwargs["clip_model"])
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    transform = transforms.Compose(
        [
            transforms.Resize(32, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )

    def unit(x: torch.Tensor) -> torch.Tensor:
        x = x if isinstance(x, torch.Tensor) else x.pooler_output
        return x / x.norm(dim=-1, keepdim=True)

    def logits(image: Image.Image, name: str, box: np.ndarray, mask: np.ndarray) -> list[float]:
        templates = [f"a photo of a {{c}} {name}", f"a photo of a {{c}}-colored {name}", "a photo of a {c} object"]
        with torch.no_grad():
            classifier = []
            for colour in rules.COLORS:
                tokens = tokenizer([t.format(c=colour) for t in templates], padding=True, return_tensors="pt")
                classifier.append(unit(unit(clip.get_text_features(**tokens)).mean(0)))
            crop = Image.composite(image, Image.new("RGB", image.size, "#999"), Image.fromarray(mask)).crop(
                tuple(box[:4])
            )  # a tuple: Pillow 13 refuses an array
            features = unit(clip.get_image_features(pixel_values=transform(crop)[None]))
        return (100.0 * features @ torch.stack(classifier).T)[0].tolist()

    return logits


def test_scores_equal_geneval_and_flow_grpo_end_to_end(detecting, tmp_path):
    reward = REWARDS.build("geneval", **detecting)
    images = _images(2 * len(RECORDS))
    records = RECORDS + RECORDS
    out = reward(images, ["p"] * len(records), records)

    pixels = (images * 255).round().to(torch.uint8)
    found = _independent_detections(detecting, pixels)
    colour_logits = _independent_colour_logits(detecting)
    geneval, server = _upstream("geneval_evaluate_images"), _upstream("reward_server_gen_eval")
    named: set[str] = set()
    for n, (record, detections) in enumerate(zip(records, found)):
        labels, scores, boxes, masks = reward.detect(pixels[n : n + 1], [0.01])[0]  # class probability > 0.01
        likely = sorted((d for d in detections if d["prob"] > 0.01), key=lambda d: -d["score"])  # the rest tie at ~1e-8
        order = scores.argsort(descending=True)  # pairs whose probabilities round to 1 in float32 come in either order
        assert labels[order].tolist() == [d["label"] for d in likely] and len(likely) >= 4
        want = torch.tensor([d["score"] for d in likely], dtype=torch.float64)
        torch.testing.assert_close(scores[order].double(), want, rtol=1e-5, atol=0)
        assert boxes[order].tolist() == [d["box"].tolist() for d in likely]
        assert all(np.array_equal(masks[i].numpy(), d["mask"]) for i, d in zip(order.tolist(), likely))

        path = str(tmp_path / f"{n}.png")
        Image.fromarray(pixels[n].permute(1, 2, 0).numpy()).save(path)
        image = Image.open(path).convert("RGB")
        colours = reward._colours(pixels[n].permute(1, 2, 0).numpy(), masks, boxes.numpy())
        for i, d in zip(order.tolist(), likely):  # each object's colour: the reward's against GenEval's way
            name = rules.OBJECT_NAMES[d["label"]]
            want = rules.COLORS[int(np.argmax(colour_logits(image, name, d["box"], d["mask"])))]
            assert colours(name, [i]) == [want]
            named.add(want)
        bbox = [np.zeros((0, 5), dtype=np.float32) for _ in range(80)]
        segm: list[list] = [[] for _ in range(80)]
        names = {}
        for d in detections:
            row = np.append(d["box"], d["score"]).astype(np.float32)[None]  # mmdet's (x1, y1, x2, y2, score)
            bbox[d["label"]] = np.concatenate([bbox[d["label"]], row])
            segm[d["label"]].append(d["mask"])
            names[id(d["mask"])] = rules.OBJECT_NAMES[d["label"]]
        for module in (geneval, server):
            module.COLOR_CLASSIFIERS.clear()
            module.DETECT = lambda inputs: [(bbox, segm)] * len(inputs) if isinstance(inputs, list) else (bbox, segm)
            module.CLIP_LOGITS = lambda box, mask: colour_logits(image, names[id(mask)], box, mask)  # noqa: B023
        official = geneval.evaluate_image(path, record)
        partial, correct, strict, _, _ = server.compute_geneval([Image.open(path)], [record], only_strict=False)
        where = f"sample {n}: {json.dumps(record)}: {official['reason']}"
        assert out.parts["correct"][n] == official["correct"] == correct[0], where
        assert out.parts["strict"][n] == strict[0], where
        assert out.parts["partial"][n] == pytest.approx(partial[0], abs=1e-7), where  # float32 of the same float
        assert out.parts[record["tag"]][n] == out.parts["correct"][n]
    assert set(out.parts["partial"].tolist()) != {0.0} and len(named) >= 2, "degenerate: nothing found or one colour"
    assert torch.equal(out.scores, out.parts["partial"])


def test_parts_not_applicable_and_score_choice(detecting):
    reward = REWARDS.build("geneval", score="correct", **detecting)
    metadata = [RECORDS[2], {}, {"prompt": "no record", "image": "elsewhere.png"}, RECORDS[5]]
    out = reward(_images(4, seed=1), ["p"] * 4, metadata)
    assert set(out.parts) == {"partial", "strict", "correct", *rules.TASKS}
    assert all(v.shape == (4,) and v.dtype == torch.float32 for v in out.parts.values())
    for key, values in out.parts.items():  # samples 1 and 2 have no record: NaN everywhere
        assert values[1:3].isnan().all(), key
    for key in rules.TASKS:  # a task's part is NaN outside its own samples
        want = [key == "counting", False, False, key == "color_attr"]
        assert (~out.parts[key].isnan()).tolist() == want, key
    assert torch.equal(out.scores.nan_to_num(-1), out.parts["correct"].nan_to_num(-1))
    again = reward(_images(4, seed=1), ["p"] * 4, metadata)
    assert all(torch.equal(again.parts[k].nan_to_num(-1), v.nan_to_num(-1)) for k, v in out.parts.items())


def test_nothing_detected_scores_zero(tmp_path):
    """Random class heads find nothing above GenEval's thresholds: every GenEval verdict 0, the partial score 0."""
    reward = REWARDS.build("geneval", **tiny_geneval(tmp_path), long_side=40)
    out = reward(_images(len(RECORDS)), ["p"] * len(RECORDS), RECORDS)
    assert out.parts["correct"].tolist() == [0.0] * len(RECORDS) and out.parts["partial"].tolist() == [0.0] * 6


def test_every_geneval_record_parses():
    lines = (UPSTREAM / "evaluation_metadata.jsonl").read_text().splitlines()
    records = [rules.parse_record(json.loads(line), f"line {i}") for i, line in enumerate(lines)]
    assert len(records) == 553 and all(r is not None for r in records)
    assert {r.tag for r in records} == set(rules.TASKS)
    assert sum(r.include[1].position is not None for r in records if r.tag == "position") == 100


# ---- the pieces by hand -----------------------------------------------------------------------------------------


def test_instances_by_hand():
    """Two queries over three classes (+ no object). Query 0's mask logits are +2 on the left half and -2 on the
    right of a 4 x 4 grid: upsampled x2 (bilinear, half-pixel centres) they stay positive up to column 3 (at
    source x = 1.25: 0.75 * 2 + 0.25 * -2 = 1) and turn negative at column 4 (-1), so its box is (0, 0, 4, 8).
    Query 1's are a constant 1: its mask is the whole image, its mask score sigmoid(1)."""
    class_logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    mask_logits = torch.stack([torch.tensor([[2.0, 2.0, -2.0, -2.0]]).expand(4, 4), torch.ones(4, 4)])
    labels, scores, boxes, masks = rules.instances(class_logits, mask_logits, (8, 8), (8, 8), (8, 8), 3, 0.2)
    p0, p1 = torch.softmax(class_logits[0].double(), 0)[0], torch.softmax(class_logits[1].double(), 0)[2]
    assert labels.tolist() == [2, 0]  # the top 3 pairs by probability are (1, 2), (0, 0), (1, 3): class 3 is no object
    up = F.interpolate(mask_logits[:1, None].double(), size=(8, 8), mode="bilinear", align_corners=False)[0, 0]
    left = up[:, :4]
    assert (left > 0).all() and (up[:, 4:] < 0).all()
    want = torch.stack([p1 * torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)), p0 * left.sigmoid().mean()])
    torch.testing.assert_close(scores.double(), want)
    assert boxes.tolist() == [[0, 0, 8, 8], [0, 0, 4, 8]]
    assert masks[0].all() and masks[1][:, :4].all() and not masks[1][:, 4:].any()
    # cut to the resized 6 x 8 image, then back to 3 x 4: the half-mask keeps its left half
    labels, scores, boxes, masks = rules.instances(class_logits, mask_logits, (8, 8), (6, 8), (3, 4), 3, 0.2)
    assert boxes.tolist() == [[0, 0, 4, 3], [0, 0, 2, 3]]
    # a higher floor keeps only what can reach it
    assert rules.instances(class_logits, mask_logits, (8, 8), (8, 8), (8, 8), 3, float(p0))[0].tolist() == [2]
    assert rules.mask_boxes(torch.zeros(1, 3, 3, dtype=torch.bool)).tolist() == [[0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("shape", "resized", "padded"),
    [
        ((512, 512), (800, 800), (800, 800)),
        ((512, 768), (800, 1200), (800, 1216)),
        ((1024, 256), (1333, 333), (1344, 352)),
        ((600, 450), (1067, 800), (1088, 800)),
    ],
)
def test_detector_input_as_mmdet(shape, resized, padded):
    """mmcv's rescale: scale = min(1333 / long side, 800 / short side), size int(side * scale + 0.5); pad to 32."""
    pixels = torch.full((1, 3, *shape), 100, dtype=torch.uint8)
    inputs, size = rules.detector_input(pixels, 800, 1333)
    assert size == resized and tuple(inputs.shape[-2:]) == padded
    mean, std = torch.tensor(rules.DETECTOR_MEAN), torch.tensor(rules.DETECTOR_STD)
    torch.testing.assert_close(inputs[0, :, 0, 0], (100 - mean) / std)
    assert inputs[0, :, resized[0] :, :].abs().sum() == 0 and inputs[0, :, :, resized[1] :].abs().sum() == 0


@pytest.mark.parametrize("box", [(3, 5, 30, 12), (2.5, 3.5, 9.5, 40.0), (0, 0, 36, 40), (10, 10, 11, 12)])
def test_colour_crop_matches_genevals_pil_and_torchvision(box):
    from torchvision import transforms

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(40, 36, 3), dtype=np.uint8)
    mask = rng.random((40, 36)) < 0.6
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    ours = rules.colour_crop(image, mask, np.array(box, dtype=np.float32), 24, mean, std)
    pil = Image.fromarray(image)
    crop = Image.composite(pil, Image.new("RGB", pil.size, "#999"), Image.fromarray(mask)).crop(
        tuple(np.array(box, dtype=np.float32))
    )
    transform = transforms.Compose(
        [
            transforms.Resize(24, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(24),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    torch.testing.assert_close(ours, transform(crop), rtol=0, atol=1e-6)


# ---- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"include": [{"class": "dog", "count": 1}]}, r"metadata\[0\]\.tag=None is not a GenEval task"),
        ({"tag": "color", "include": []}, r"tag='color' .*did you mean 'colors'"),
        ({"tag": "colors"}, r"metadata\[0\]\.include=None must be a non-empty list"),
        ({"tag": "colors", "include": [{"class": "dog"}]}, r"include\[0\]=.* must be a dict with 'class' and 'count'"),
        ({"tag": "colors", "include": [{"class": "dgo", "count": 1}]}, r"include\[0\]\.class='dgo' .*'dog'"),
        ({"tag": "counting", "include": [{"class": "dog", "count": 0}]}, r"include\[0\]\.count=0 must be a whole"),
        ({"tag": "counting", "include": [{"class": "dog", "count": "2"}]}, r"count='2' must be a whole number"),
        ({"tag": "colors", "include": [{"class": "dog", "count": 1, "colour": "red"}]}, r"key 'colour'.*'color'"),
        ({"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "teal"}]}, r"color='teal' is not a"),
        (
            {"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]},
            r"include\[0\]\.position=\['left of', 0\] must be \[relation, index of an earlier include entry\]",
        ),
        (
            {
                "tag": "position",
                "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left", 0]}],
            },
            r"include\[1\]\.position=.*'left of'",
        ),
        ({"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": {"class": "dog"}}, r"exclude="),
        ("a photo of a dog", r"metadata\[0\] is a str; pass a dict"),
    ],
)
def test_bad_records_name_the_field_and_the_fix(record, match, detecting):
    reward = REWARDS.build("geneval", **detecting)
    with pytest.raises(ValueError, match=match):
        reward(_images(1), ["a photo"], [record])


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"score": "accuracy"}, r"score='accuracy' is not one of \('partial', 'strict', 'correct'\)"),
        ({"threshold": 1.5}, r"threshold=1.5 must be in \[0, 1\) \(GenEval's default: 0.3\)"),
        ({"max_objects": 0}, r"max_objects=0 must be a whole number >= 1"),
        ({"max_overlap": 0.0}, r"max_overlap=0.0 must be in \(0, 1\]"),
        ({"short_side": 900}, r"long_side=40 must be a whole number >= 900"),
        ({"max_detections": 2.5}, r"max_detections=2.5 must be a whole number"),
    ],
)
def test_bad_settings_name_the_field(setting, match, detecting):
    with pytest.raises(ValueError, match=match):
        REWARDS.build("geneval", **{**detecting, **setting})


def test_detector_without_coco_classes_is_refused(tmp_path):
    """A Mask2Former trained on other classes (ADE20k's 150, Cityscapes' 19) loads, but its labels are not GenEval's."""
    kwargs = tiny_geneval(tmp_path, num_labels=10)
    with pytest.raises(ValueError, match=r"has 10 classes, not COCO's 80 things; pass a COCO instance model"):
        REWARDS.build("geneval", **kwargs, long_side=40)


def test_offline_without_the_weights_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(FileNotFoundError) as caught:
        REWARDS.build("geneval")
    message = str(caught.value)
    assert "\n" not in message and "facebook/mask2former-swin-small-coco-instance" in message
    assert "`hf download facebook/mask2former-swin-small-coco-instance`" in message
