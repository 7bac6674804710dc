"""openai_judge against a real local OpenAI-compatible endpoint (tests/rewards/judge_server.py): the parsed scores
against the endpoint's rule computed here, the request it receives, the concurrency limit, retries, and one-line
errors."""

import base64

import pytest
import torch
from judge_server import rule, start_judge

from flowrl.media import encode_pngs
from flowrl.registry import REWARDS
from flowrl.rewards.openai_judge import parse_score


def build(server, **kwargs):
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    return REWARDS.build("openai_judge", base_url=url, model="judge-7b", timeout_s=10, backoff_s=0.01, **kwargs)


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 16, 12, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("reply", ["unifiedreward", "number"])
def test_scores_are_the_judges_parsed_and_scaled_and_the_request_is_the_openai_form(reply):
    server = start_judge(reply)
    batch = images(3)
    scores = build(server, reply_format=reply, api_key="k3y")(batch, ["a red fox", "b", "c"], [{}, {}, {}]).scores
    expected = [rule(png) for png in encode_pngs(batch)]  # the endpoint's rule, on the PNGs encoded here
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx(expected, abs=1e-5)
    first = next(r for r in server.requests if "a red fox" in r["body"]["messages"][0]["content"][1]["text"])
    assert (
        first["auth"] == "Bearer k3y" and first["body"]["model"] == "judge-7b" and first["body"]["temperature"] == 0.0
    )
    image_part = first["body"]["messages"][0]["content"][0]
    assert image_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1]) == encode_pngs(batch[:1])[0]
    server.shutdown()


def test_requests_run_at_most_concurrency_at_once():
    server = start_judge(delay_s=0.05)
    build(server, concurrency=2)(images(6), ["p"] * 6, [{}] * 6)
    assert server.peak == 2 and len(server.requests) == 6
    server.shutdown()


def test_an_overloaded_endpoint_is_retried_then_fails_in_one_line():
    server = start_judge(fail_first=2)
    scores = build(server, concurrency=1, max_retries=2)(images(1), ["p"], [{}]).scores  # 2 x 503, then the answer
    assert len(server.requests) == 3 and scores.tolist() == pytest.approx([rule(encode_pngs(images(1))[0])], abs=1e-5)
    server.fail_first = 5
    with pytest.raises(ConnectionError, match=r"HTTP 503: .*overloaded.* after 2 attempts"):
        build(server, concurrency=1, max_retries=1)(images(1), ["p"], [{}])
    server.shutdown()


def test_a_reply_without_a_score_and_bad_settings_are_one_line_errors():
    server = start_judge("nonsense")
    with pytest.raises(ValueError, match=r"no unifiedreward score in the reply 'I cannot rate this image.'"):
        build(server)(images(1), ["p"], [{}])
    server.shutdown()
    with pytest.raises(ValueError, match="model is empty"):
        REWARDS.build("openai_judge", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="template has no {prompt}"):
        REWARDS.build("openai_judge", base_url="http://127.0.0.1:9/v1", model="m", template="Rate it.")
    with pytest.raises(ValueError, match="reply_format='stars' must be one of unifiedreward, number"):
        REWARDS.build("openai_judge", base_url="http://127.0.0.1:9/v1", model="m", reply_format="stars")


def test_parse_score_reads_unifiedreward_and_plain_replies():
    assert parse_score("Alignment good. **Final Score:** 4.5", "unifiedreward") == 4.5
    assert parse_score("Final Score: 2\nFinal score: 3.25", "unifiedreward") == 3.25  # the last one counts
    assert parse_score("7/10, nice", "number") == 7.0 and parse_score("none", "number") is None
