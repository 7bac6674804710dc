"""A VLM judge behind any OpenAI-compatible chat endpoint (vLLM, SGLang, a hosted API): each image is sent as a PNG
data URL with a prompt template, and the score is parsed from the reply, divided by `max_score`.

Reply formats: `unifiedreward` (UnifiedReward's point-score answer, "... Final Score: 4.5"; max_score 5) and
`number` (the first number of the reply, e.g. a plain 0-10 rating). Requests run `concurrency` at a time, each with
`timeout_s`; a connection failure, a timeout or a 429/5xx answer is retried `max_retries` times. A reply with no
score, or an endpoint that still fails, raises one line naming the endpoint and the cause, and the trainer's
`on_reward_error` policy decides what happens to the sample.
"""

from __future__ import annotations

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from flowrl.media import encode_pngs
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._http import HTTPStatusError, NoAnswer, exchange, status_line

TEMPLATES = {
    "unifiedreward": (
        "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
        "based on two key criteria: 1. Alignment with the caption 2. Overall image quality. Give a final score from 1 "
        "to 5 in the form 'Final Score: X'. Caption: {prompt}"
    ),
    "number": "Rate from 0 to 10 how well this image matches the caption and how good it looks. Answer with the number "
    "only. Caption: {prompt}",
}
PATTERNS = {
    "unifiedreward": re.compile(r"Final Score:\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE),
    "number": re.compile(r"[-+]?\d+(?:\.\d+)?"),
}
MAX_SCORES = {"unifiedreward": 5.0, "number": 10.0}
RETRY_STATUS = (429, 500, 502, 503, 504)


def parse_score(reply: str, reply_format: str) -> float | None:
    """The score in a judge's reply (the last 'Final Score' for unifiedreward, the first number otherwise)."""
    found = PATTERNS[reply_format].findall(reply)
    if not found:
        return None
    return float(found[-1] if reply_format == "unifiedreward" else found[0])


@REWARDS.register("openai_judge")
class OpenAIJudgeReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        base_url: str = "",
        model: str = "",
        api_key: str | None = None,
        reply_format: str = "unifiedreward",
        template: str | None = None,
        max_score: float | None = None,
        max_tokens: int = 256,
        concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
    ):
        where = f"openai_judge base_url={base_url!r}"
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{where} must be the endpoint's http(s) URL, e.g. http://127.0.0.1:8000/v1")
        if not model:
            raise ValueError(
                "openai_judge model is empty; pass the served model's name (vLLM: its --served-model-name)"
            )
        if reply_format not in PATTERNS:
            raise ValueError(f"openai_judge reply_format={reply_format!r} must be one of {', '.join(PATTERNS)}")
        if template is not None and "{prompt}" not in template:
            raise ValueError("openai_judge template has no {prompt}; put {prompt} where the caption goes")
        if concurrency < 1 or max_retries < 0:
            raise ValueError(f"openai_judge concurrency={concurrency} must be >= 1 and max_retries={max_retries} >= 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.reply_format = model, api_key, reply_format
        self.template = template or TEMPLATES[reply_format]
        self.max_score = float(max_score if max_score is not None else MAX_SCORES[reply_format])
        self.max_tokens, self.concurrency, self.timeout_s = max_tokens, concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def request_body(self, png: bytes, prompt: str) -> bytes:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": self.template.format(prompt=prompt)},
        ]
        message = {"role": "user", "content": content}
        body = {"model": self.model, "messages": [message], "max_tokens": self.max_tokens, "temperature": 0.0}
        return json.dumps(body).encode()

    def _ask(self, png: bytes, prompt: str) -> float:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        args = (self.timeout_s, self.max_retries, self.backoff_s, RETRY_STATUS)
        try:
            answer = json.loads(exchange(self.url, self.request_body(png, prompt), headers, *args))
        except HTTPStatusError as err:
            raise RuntimeError(f"openai_judge {self.url}: {status_line(err.code, err.body, err.reason)}") from None
        except NoAnswer as err:
            raise ConnectionError(f"openai_judge {self.url}: {err.last} after {err.attempts} attempts") from None
        except ValueError:
            raise RuntimeError(f"openai_judge {self.url}: the answer is not JSON") from None
        try:
            reply = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"openai_judge {self.url}: the answer has no choices[0].message.content") from None
        score = parse_score(reply or "", self.reply_format)
        if score is None:
            shown = " ".join((reply or "").split())[:120]
            raise ValueError(f"openai_judge {self.url}: no {self.reply_format} score in the reply {shown!r}")
        return score / self.max_score

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        pngs = encode_pngs(images)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(pngs))) as pool:
            scores = list(pool.map(self._ask, pngs, prompts))
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))
