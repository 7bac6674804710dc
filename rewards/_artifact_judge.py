"""The artifact reward's VLM-judge backend: a transformers vision-language model (a local folder or a hub id) asked
the ArtifactReward paper's yes/no question (docs/rewards.md#artifact-reward); returns logp_yes - logp_no at the first
answer token, where each side sums the probability of its case/space variants that are single tokens.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from flowrl.hub import hub_errors, is_hub_id
from flowrl.media import to_uint8

ARTIFACT_QUESTION = (
    "Analyze the images to identify any unintentional digital artifacts, concentrating on irregular lighting, "
    "object placement, blending errors, or anomalies that could affect realism. Disregard any deliberate artistic "
    "styles or intentional surreal elements. Respond with YES if artifacts are detected; if not, respond with NO."
)


def answer_token_ids(tokenizer: Any, word: str) -> list[int]:
    """Ids of the single-token spellings of `word` (yes, Yes, YES, with and without a leading space)."""
    ids = set()
    for variant in (word.lower(), word.capitalize(), word.upper()):
        for spelled in (variant, " " + variant):
            encoded = tokenizer.encode(spelled, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] != tokenizer.unk_token_id:
                ids.add(encoded[0])
    return sorted(ids)


class VLMArtifactJudge:
    def __init__(self, model_name: str | None, device: torch.device, dtype: torch.dtype, question: str | None = None):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if not model_name:
            raise ValueError(
                "artifact: backend='vlm' needs model_name=/path/to/vlm (e.g. a local Qwen2.5-VL-7B-Instruct folder)"
            )
        if not os.path.isdir(model_name) and not is_hub_id(model_name):
            raise FileNotFoundError(
                f"artifact: model_name={model_name!r} is neither a local folder nor a hub id (org/name)"
            )
        with hub_errors(model_name, "artifact: VLM") if not os.path.isdir(model_name) else contextlib.nullcontext():
            self.processor = AutoProcessor.from_pretrained(model_name)
            self.model = AutoModelForImageTextToText.from_pretrained(model_name, dtype=dtype)
        self.model = self.model.to(device).eval().requires_grad_(False)
        self.device, self.question = device, question or ARTIFACT_QUESTION
        tokenizer = self.processor.tokenizer
        self.yes_ids, self.no_ids = answer_token_ids(tokenizer, "yes"), answer_token_ids(tokenizer, "no")
        if not self.yes_ids or not self.no_ids:
            raise ValueError(
                f"artifact: the tokenizer of {model_name!r} has no single token for yes/no; "
                "use an instruction-tuned VLM"
            )
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.question}]}]
        self.chat = self.processor.apply_chat_template(messages, add_generation_prompt=True)

    @torch.no_grad()
    def yes_minus_no(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] in [0, 1] -> [N] logp_yes - logp_no of the first answer token (one image per forward)."""
        from PIL import Image

        out = []
        for image in images:
            pil = Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy())
            inputs = self.processor(images=[pil], text=[self.chat], return_tensors="pt").to(self.device)
            log_probs = torch.log_softmax(self.model(**inputs).logits[0, -1].float(), dim=-1)  # [V]
            out.append(torch.logsumexp(log_probs[self.yes_ids], 0) - torch.logsumexp(log_probs[self.no_ids], 0))
        return torch.stack(out)  # [N]
