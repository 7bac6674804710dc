"""GenEval (Ghosh et al. 2023) scored in-process: a Mask2Former COCO instance model finds the objects, CLIP names
their colours, and GenEval's rules (rewards/_geneval_rules.py) give GenEval's verdict and flow_grpo's strict and
partial scores, without mmdet, mmcv or a reward server.

The metadata of a sample is its GenEval record (`tag`, `include`, `exclude`, `prompt`), as GenEval's
`evaluation_metadata.jsonl` and flow_grpo's `dataset/geneval/*_metadata.jsonl` hold them; a sample without one scores
NaN. GenEval runs mmdet's Mask2Former Swin-S (images resized to fit 1333 x 800, ImageNet-normalised, padded to a
multiple of 32; top 100 detections); this reward runs that architecture through transformers with the same input and
mmdet's instance post-processing, by default with facebook/mask2former-swin-small-coco-instance (the Mask2Former
authors' COCO weights; GenEval's checkpoint is mmdet's own training, so single detections can differ). Colours: each
object's mask pasted on GenEval's grey (#999), cut to its box, classified by CLIP (openai/clip-vit-large-patch14, the
weights of GenEval's open_clip ViT-L-14 "openai") against GenEval's three templates per colour.

Parts, each [N] (NaN where not applicable): `correct` (GenEval's verdict, 0/1: the number its benchmark averages),
`strict` (flow_grpo's: exact counts, exclusions not read), `partial` (flow_grpo's reward, at most 1, negative when
far too many objects are found), and per task (`single_object`, `two_object`, `counting`, `colors`, `position`,
`color_attr`) GenEval's verdict on the samples of that task. `score` picks which of the first three is the score.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowrl.hub import hub_errors, is_hub_id
from flowrl.media import to_uint8
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from . import _geneval_rules as rules

SCORES = ("partial", "strict", "correct")


def _pretrained(cls: Any, name: str, what: str, **kwargs: Any) -> Any:
    if os.path.isdir(name):
        return cls.from_pretrained(name, **kwargs)
    if not is_hub_id(name):
        raise FileNotFoundError(f"geneval: {what} {name!r} is neither a local folder nor a hub id (org/name); pass one")
    with hub_errors(name, f"geneval: {what}"):
        return cls.from_pretrained(name, **kwargs)


def _features(output: Any) -> torch.Tensor:
    """get_image_features / get_text_features: a tensor in transformers 4.x, an output with `pooler_output` in 5.x."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _detector_class() -> type:
    """Mask2FormerForUniversalSegmentation's weights and inference, without its training loss (which needs scipy)."""
    from transformers import Mask2FormerModel, Mask2FormerPreTrainedModel

    class Mask2FormerDetector(Mask2FormerPreTrainedModel):
        def __init__(self, config: Any):
            super().__init__(config)
            self.model = Mask2FormerModel(config)
            self.class_predictor = torch.nn.Linear(config.hidden_dim, config.num_labels + 1)
            self.post_init()

        def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(pixel_values=pixel_values, output_hidden_states=True, return_dict=True)
            class_logits = self.class_predictor(out.transformer_decoder_intermediate_states[-1].transpose(0, 1))
            return class_logits, out.masks_queries_logits[-1]  # [N, Q, C + 1], [N, Q, H / 4, W / 4]

    return Mask2FormerDetector


@REWARDS.register("geneval")
class GenEvalReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        detector_model: str = "facebook/mask2former-swin-small-coco-instance",
        clip_model: str = "openai/clip-vit-large-patch14",
        score: str = "partial",
        threshold: float = 0.3,
        counting_threshold: float = 0.9,
        max_objects: int = 16,
        max_overlap: float = 1.0,
        position_threshold: float = 0.1,
        max_detections: int = 100,
        short_side: int = 800,
        long_side: int = 1333,
    ):
        from transformers import CLIPModel, CLIPProcessor, Mask2FormerConfig

        if score not in SCORES:
            hint = "partial: flow_grpo's reward; strict: its 0/1 verdict; correct: GenEval's 0/1 verdict"
            raise ValueError(f"geneval score={score!r} is not one of {SCORES} ({hint})")
        for key, value, least, default in (
            ("max_detections", max_detections, 1, 100),
            ("short_side", short_side, 32, 800),
            ("long_side", long_side, short_side, 1333),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"geneval {key}={value!r} must be a whole number >= {least} (mmdet's: {default})")
        self.device, self.dtype, self.score = torch.device(device), dtype, score
        self.thresholds = rules.Thresholds(threshold, counting_threshold, max_objects, max_overlap, position_threshold)
        self.max_detections, self.short_side, self.long_side = max_detections, short_side, long_side
        config = _pretrained(Mask2FormerConfig, detector_model, "detector")
        if config.num_labels != len(rules.OBJECT_NAMES):
            raise ValueError(
                f"geneval: detector {detector_model!r} has {config.num_labels} classes, not COCO's 80 things; "
                "pass a COCO instance model such as facebook/mask2former-swin-small-coco-instance"
            )
        detector = _pretrained(_detector_class(), detector_model, "detector", config=config, dtype=dtype)
        self.detector = detector.to(self.device).eval().requires_grad_(False)
        processor = _pretrained(CLIPProcessor, clip_model, "CLIP processor")
        self.tokenizer, image_processor = processor.tokenizer, processor.image_processor
        if len(self.tokenizer) <= 10:
            raise FileNotFoundError(
                f"geneval: the tokenizer of {clip_model!r} is empty (a partial download); pass a complete folder"
            )
        crop = image_processor.crop_size
        crop = int(crop["height"] if isinstance(crop, dict) else crop.height)
        self.clip_input = (crop, tuple(image_processor.image_mean), tuple(image_processor.image_std))
        clip = _pretrained(CLIPModel, clip_model, "CLIP model", dtype=dtype)
        self.clip = clip.to(self.device).eval().requires_grad_(False)
        self._classifiers: dict[str, torch.Tensor] = {}

    def _classifier(self, name: str) -> torch.Tensor:
        """[D, len(COLORS)]: per colour, the normalised mean of its templates' normalised text embeddings."""
        if name not in self._classifiers:
            texts = [t.format(c=c, name=name) for c in rules.COLORS for t in rules.COLOUR_TEMPLATES]
            tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
            embeds = F.normalize(_features(self.clip.get_text_features(**tokens.to(self.device))).float(), dim=-1)
            means = embeds.view(len(rules.COLORS), len(rules.COLOUR_TEMPLATES), -1).mean(1)  # [colours, D]
            self._classifiers[name] = F.normalize(means, dim=-1).T
        return self._classifiers[name]

    @torch.no_grad()
    def detect(self, pixels: torch.Tensor, min_scores: list[float]) -> list[tuple[torch.Tensor, ...]]:
        """uint8 [N, 3, H, W] -> per image (labels, scores, boxes, masks) of `rules.instances`, on the CPU."""
        inputs, size = rules.detector_input(pixels.to(self.device), self.short_side, self.long_side)
        outputs = self.detector(inputs.to(self.dtype))  # class logits [N, Q, C + 1], mask logits [N, Q, h, w]
        sizes = (inputs.shape[-2:], size, pixels.shape[-2:])  # padded input, resized image, image
        found = [rules.instances(*logits, *sizes, self.max_detections, s) for *logits, s in zip(*outputs, min_scores)]
        return [tuple(t.cpu() for t in detections) for detections in found]

    def _colours(self, image: np.ndarray, masks: torch.Tensor, boxes: np.ndarray) -> rules.Colours:
        named: dict[int, str] = {}

        def colours(name: str, indices: list[int]) -> list[str]:
            todo = [i for i in indices if i not in named]
            if todo:
                crops = [rules.colour_crop(image, masks[i].numpy(), boxes[i], *self.clip_input) for i in todo]
                pixel_values = torch.stack(crops).to(self.device, self.dtype)
                embeds = F.normalize(_features(self.clip.get_image_features(pixel_values=pixel_values)).float(), dim=-1)
                named.update(zip(todo, rules.colour_names(embeds @ self._classifier(name))))
            return [named[i] for i in indices]

        return colours

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        records = [rules.parse_record(meta, f"geneval: metadata[{i}]") for i, meta in enumerate(metadata)]
        values = {key: [math.nan] * len(prompts) for key in (*SCORES, *rules.TASKS)}
        todo = [i for i, record in enumerate(records) if record is not None]
        if todo:
            pixels = to_uint8(images[todo])  # 8-bit, as GenEval reads its PNG files
            t = self.thresholds
            limits = [t.counting_threshold if records[i].tag == "counting" else t.threshold for i in todo]
            for i, image, (labels, scores, boxes, masks) in zip(todo, pixels, self.detect(pixels, limits)):
                record, boxes = records[i], boxes.numpy()
                objects = rules.keep_objects(labels.numpy(), scores.numpy(), boxes, record.tag, t)
                colours = self._colours(image.permute(1, 2, 0).cpu().numpy(), masks, boxes)
                args = (record, objects, boxes, colours, t.position_threshold)
                correct = float(rules.geneval_correct(*args))
                values["correct"][i], values[record.tag][i] = correct, correct
                values["strict"][i] = float(rules.flowgrpo_strict(*args))
                values["partial"][i] = rules.flowgrpo_partial(*args)
        parts = {key: torch.tensor(v, dtype=torch.float32) for key, v in values.items()}
        return RewardOutput(scores=parts[self.score].clone(), parts=parts)
