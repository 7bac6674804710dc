"""toy_geneval and toy_geneval_exact: GenEval's rules (rewards/_geneval_rules.py) over the Shapes world's detections,
for its two-object and position prompts ("a red circle and a blue square", "a red circle left of a blue square").

Each sample's GenEval record (`tag`, `include`, `exclude`, `prompt`) is its metadata's when that holds one, else the
record its prompt's grammar gives (flowrl/toy/world.py `PairSpec.record`); either way it goes through GenEval's record
parser, with the world's shapes as the class names. A prompt outside the families without a record raises ValueError.
The detections (flowrl/toy/detect.py) then pass GenEval's object filter (`keep_objects`: scores above 0.3, at most 16
per class) and its verdicts: an object's colour is the detector's reading, a position holds by the relative centres of
the boxes with GenEval's margin (`position_threshold`, default GenEval's 0.1 of the two boxes' summed size per axis).

* `toy_geneval_exact`, the grade: the exact checker's shapes (no learned part), score `correct`, GenEval's verdict.
* `toy_geneval`, the Shapes world's GenEval: instances found off the background and read by the attribute judge (its
  `checkpoint`, default the shipped one), score `partial`, flow_grpo's reward (its strict verdict and GenEval's too).

Parts, each [N] float32 (NaN where not applicable): `correct` (GenEval's verdict, 0/1), `strict` (flow_grpo's: exact
counts, exclusions not read), `partial` (flow_grpo's reward, at most 1), and per GenEval task GenEval's verdict on the
samples of that task. `score` picks which of the first three is the score. Not differentiable; images of any size
(resized to 32x32); scores on the reward's device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from . import _geneval_rules as rules

SCORES = ("partial", "strict", "correct")


def toy_records(prompts: list[str], metadata: list[dict[str, Any]] | None, who: str) -> list[rules.Record]:
    """Each sample's GenEval record, parsed by GenEval's parser with the world's shapes as class names (module
    docstring)."""
    from flowrl.toy.world import SHAPES, parse_pair_prompt

    metadata = metadata if metadata is not None else [{} for _ in prompts]
    records = []
    for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
        record = rules.parse_record(meta, f"{who}: metadata[{i}]", names=SHAPES)
        if record is None:  # ValueError naming a prompt outside the families
            record = rules.parse_record(parse_pair_prompt(prompt).record, f"{who}: prompt {prompt!r}", names=SHAPES)
        records.append(record)
    return records


class _ToyGenEval:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(self, device: Any, dtype: torch.dtype, score: str, position_threshold: float):
        if score not in SCORES:
            hint = "partial: flow_grpo's reward; strict: its 0/1 verdict; correct: GenEval's 0/1 verdict"
            raise ValueError(f"{self.registry_name}: score={score!r} is not one of {SCORES} ({hint})")
        self.device, self.dtype, self.score = torch.device(device), dtype, score
        self.thresholds = rules.Thresholds(position_threshold=position_threshold)  # ValueError naming a bad margin

    def detect(self, images: torch.Tensor) -> list:
        """Images [N, 3, H, W] -> one flowrl.toy.detect.Detections per image."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        from flowrl.toy.world import SHAPES

        check_inputs(self.registry_name, images, prompts, metadata)
        records = toy_records(prompts, metadata, self.registry_name)
        values = {key: [math.nan] * len(prompts) for key in (*SCORES, *rules.TASKS)}
        for i, (record, found) in enumerate(zip(records, self.detect(images))):
            boxes = found.boxes.numpy()
            objects = rules.keep_objects(
                found.labels.numpy(), found.scores.numpy(), boxes, record.tag, self.thresholds, SHAPES
            )

            def colours(name: str, indices: list[int], found=found) -> list[str]:
                return [found.colours[k] for k in indices]

            args = (record, objects, boxes, colours, self.thresholds.position_threshold)
            values["correct"][i] = values[record.tag][i] = float(rules.geneval_correct(*args))
            values["strict"][i] = float(rules.flowgrpo_strict(*args))
            values["partial"][i] = rules.flowgrpo_partial(*args)
        parts = {key: torch.tensor(v, dtype=torch.float32, device=self.device) for key, v in values.items()}
        return RewardOutput(scores=parts[self.score].clone(), parts=parts)


@REWARDS.register("toy_geneval_exact")
class ToyGenEvalExactReward(_ToyGenEval):
    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        score: str = "correct",
        position_threshold: float = 0.1,
    ):
        super().__init__(device, dtype, score, position_threshold)

    def detect(self, images: torch.Tensor) -> list:
        from flowrl.toy.detect import exact_detections

        return exact_detections(images.cpu())


@REWARDS.register("toy_geneval")
class ToyGenEvalReward(_ToyGenEval):
    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        score: str = "partial",
        position_threshold: float = 0.1,
        checkpoint: str | None = None,
    ):
        from flowrl.toy.judges import load_judge

        super().__init__(device, dtype, score, position_threshold)
        self.judge = load_judge("attributes", checkpoint, device=self.device, dtype=dtype)

    def detect(self, images: torch.Tensor) -> list:
        from flowrl.toy.detect import judge_detections

        return judge_detections(images, self.judge)
