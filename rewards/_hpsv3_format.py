"""HPSv3's official format (MizzenAI/HPSv3, package hpsv3 1.0.0), read by rewards/hpsv3.py.

- Checkpoint: one file, `HPSv3.safetensors` (or a torch file holding the state dict, optionally under "model"), with
  the whole reward model as transformers 4.45 names Qwen2-VL: `visual.*` (vision tower and merger), `model.*` (the
  language model; its embedding has one row per token of the tokenizer with <|Reward|> added), `lm_head.weight`
  (not used to score) and `rm_head.{0,3,5}.{weight,bias}`: the ranknet head Linear(hidden, 1024) - ReLU - Dropout -
  Linear(1024, 16) - ReLU - Linear(16, 2), whose outputs are (mu, log sigma). Files saved by transformers 5
  (`model.visual.*`, `model.language_model.*`) load too.
- Config and tokenizer: those of the base model, Qwen/Qwen2-VL-7B-Instruct (a local folder or the hub id).
- Input: the Qwen2-VL chat layout with its default system prompt; the user turn is the image, then INSTRUCTION with
  the prompt, then the rating request that ends in <|Reward|>. The head reads the last hidden state (after the final
  norm) at that token; the language model runs with sequential positions 0..L-1 (HPSv3 computes no multimodal
  rotary positions) and right padding.
- Image: resized (bicubic) to multiples of 28 px (patch 14 x merge 2) keeping the aspect, to an area between
  `min_pixels` and `max_pixels` (both 256 x 28 x 28 in the release: 448 x 448 for a square image), then OpenAI CLIP
  mean/std, and patchified as Qwen2-VL's image processor does (each image is its own second temporal frame).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

REPO = "MizzenAI/HPSv3"
CHECKPOINT_FILE = "HPSv3.safetensors"
BASE_MODEL = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # min_pixels = max_pixels of the release (its HPSv3_7B.yaml and inference code)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HEAD_WIDTHS = (1024, 16, 2)  # the ranknet head's Linear outputs; its Linears sit at rm_head.0, .3 and .5
HEAD_INDICES = (0, 3, 5)

INSTRUCTION = "\n".join(
    (
        "",
        "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a "
        "overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst "
        "and 10 being the best. ",
        "",
        "**Visual Quality:**  ",
        "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:",
        "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as "
        "abnormal body structures or nonsensical environmental setups.",
        "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to "
        "interpret, with no blurring or indistinct areas.",
        "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
        "elements (e.g., hair, clothing, shadows).",
        "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
        "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of "
        "harmony and balance.",
        "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or "
        "adult material. If such content is present, the image quality and satisfaction score should be the lowest "
        "possible. ",
        "",
        "**Text Alignment:**  ",
        "Assess how well the image matches the textual prompt across the following sub-dimensions:",
        "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) "
        "align with the textual description. The subject should match the description in terms of number, appearance, "
        "and behavior.",
        "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well "
        "the image adheres to this style.",
        "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image "
        "logically fit the scenario described in the prompt. The environment should support and enhance the subject "
        "without contradictions.",
        "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, "
        "accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be "
        "acceptable, but critical attributes should be preserved.",
        "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the "
        "image. The generated content should not introduce elements that conflict with or distort the original "
        "description.",
        "Textual prompt - {prompt}",
        "",
        "",
        "",
    )
)
RATING_REQUEST = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def chat_text(prompt: str, image_tokens: int) -> str:
    """The model's input text for one image and prompt: Qwen2-VL's chat template with the generation prompt, the
    image placeholder expanded to its `image_tokens` merged patches."""
    user = INSTRUCTION.replace("{prompt}", prompt) + RATING_REQUEST
    image = "<|vision_start|>" + "<|image_pad|>" * image_tokens + "<|vision_end|>"
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{image}{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def resized_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) in multiples of `factor`, nearest in aspect to the input, with an area within
    [min_pixels, max_pixels] (qwen-vl-utils' sizing rule, which HPSv3 applies before its processor)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"hpsv3: images of {height} x {width} px exceed Qwen2-VL's aspect ratio limit of 200; crop them"
        )
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / scale / factor) * factor, math.floor(width / scale / factor) * factor
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return max(factor, h), max(factor, w)


def patches(pixels: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """Normalised images [N, 3, H, W] -> Qwen2-VL's flattened patches [N * H/patch * W/patch, 3 * temporal * patch²],
    ordered by merge window (row-major), then patch within the window; each image repeated over `temporal` frames."""
    n, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, None].expand(n, temporal, c, h, w)  # [N, T, 3, H, W]
    x = x.reshape(n, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [N, gh/m, gw/m, m, m, 3, T, p, p]
    return x.reshape(n * gh * gw, c * temporal * patch * patch)


def head(hidden_size: int) -> torch.nn.Sequential:
    """The ranknet head on the hidden state of <|Reward|>: [N, hidden_size] -> [N, 2] (mu, log sigma)."""
    return torch.nn.Sequential(
        torch.nn.Linear(hidden_size, HEAD_WIDTHS[0]),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.05),
        torch.nn.Linear(HEAD_WIDTHS[0], HEAD_WIDTHS[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(HEAD_WIDTHS[1], HEAD_WIDTHS[2]),
    )


def read_checkpoint(path: str) -> Mapping[str, torch.Tensor]:
    """The state dict of an HPSv3 checkpoint file (safetensors; else a torch file), without the language head."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"hpsv3: checkpoint {path!r} does not exist; download {CHECKPOINT_FILE} from https://huggingface.co/{REPO}"
        )
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:  # lm_head (1 GB in the release) is not read
            return {key: f.get_tensor(key) for key in f.keys() if not key.startswith("lm_head.")}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return state.get("model", state) if isinstance(state, dict) else state


def split_checkpoint(state: Mapping[str, torch.Tensor], hidden_size: int, path: str) -> tuple[dict, dict]:
    """(backbone state dict in transformers 5's Qwen2VLModel names, head state dict) of an HPSv3 checkpoint, after
    checking the head's names and sizes; a wrong file fails with one line naming the key, its value and the fix."""
    fix = f"pass the full reward checkpoint, {CHECKPOINT_FILE} from https://huggingface.co/{REPO}"
    expected = {}
    widths = (hidden_size, *HEAD_WIDTHS)
    for index, d_in, d_out in zip(HEAD_INDICES, widths[:-1], widths[1:]):
        expected[f"rm_head.{index}.weight"], expected[f"rm_head.{index}.bias"] = (d_out, d_in), (d_out,)
    for key, shape in expected.items():
        if key not in state:
            raise ValueError(f"hpsv3: checkpoint {path!r} has no {key} (the ranknet reward head); {fix}")
        if tuple(state[key].shape) != shape:
            why = (
                "the base model's hidden size" if key == "rm_head.0.weight" else "HPSv3's (mu, log sigma) ranknet head"
            )
            raise ValueError(
                f"hpsv3: checkpoint {key} has shape {tuple(state[key].shape)}, not {shape} ({why}); {fix}, with the "
                f"config of {BASE_MODEL}"
            )
    rows = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    if not any(key in state for key in rows):
        raise ValueError(f"hpsv3: checkpoint {path!r} has no {rows[0]} (the language model); {fix}")
    head_state = {key[len("rm_head.") :]: state[key] for key in expected}
    backbone = {}
    for key, value in state.items():
        if key.startswith(("rm_head.", "lm_head.")):
            continue  # lm_head: the language head, unused by the score
        for old, new in (
            ("model.visual.", "visual."),
            ("model.language_model.", "language_model."),
            ("model.", "language_model."),
        ):
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        backbone[key] = value
    return backbone, head_state
