"""remote_flowgrpo against a real local server of flow_grpo's protocol (tests/rewards/flowgrpo_server.py): the scores
of JPEGs encoded here apart, what the request carries, the opt-in, and one-line errors for a crafted, malformed or
failed answer."""

import io
import os

import numpy as np
import pytest
import torch
from flowgrpo_server import start_server
from PIL import Image

from flowrl.registry import REWARDS


def build(server, **kwargs):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return REWARDS.build("remote_flowgrpo", url=url, unsafe_unpickle=True, timeout_s=10, **kwargs)


class RunsCode:
    """Pickles as a call of os.getpid: what a hostile server could send instead of scores."""

    def __reduce__(self):
        return (os.getpid, ())


def test_scores_are_the_servers_on_the_jpegs_and_the_request_carries_prompts_metadata_and_extras():
    server = start_server()
    images = torch.rand(3, 3, 24, 20, generator=torch.Generator().manual_seed(0))
    metadata = [{}, {"bonus": True}, {"tag": "counting"}]
    reward = build(server, extra={"only_strict": False}, jpeg_quality=90)
    scores = reward(images, ["a", "b", "c"], metadata).scores

    expected = []  # JPEG-encoded and decoded here, with PIL directly
    for image, meta in zip(images, metadata):
        pixels = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        decoded = np.asarray(Image.open(io.BytesIO(buffer.getvalue())), dtype=np.float64)
        expected.append(decoded.mean() / 255 + (1.0 if meta.get("bonus") else 0.0))
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx(expected, abs=1e-6)
    sent = server.requests[0]
    assert [m["prompt"] for m in sent["meta_datas"]] == ["a", "b", "c"] and sent["meta_datas"][2]["tag"] == "counting"
    assert sent["only_strict"] is False and len(sent["images"]) == 3
    server.shutdown()


def test_the_unsafe_unpickle_opt_in_is_required():
    with pytest.raises(ValueError, match="set unsafe_unpickle: true only for a server you trust"):
        REWARDS.build("remote_flowgrpo", url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="must be the server's http"):
        REWARDS.build("remote_flowgrpo", url="127.0.0.1:9", unsafe_unpickle=True)


@pytest.mark.parametrize(
    "answer, score_key, message",
    [
        (RunsCode(), "scores", r"not a readable pickle of plain values \(the answer names (posix|nt)\.getpid"),
        ({"outputs": [1.0, 2.0]}, "scores", r"no 2 scores under 'scores' \(it holds \['outputs'\]\); set score_key"),
        ({"scores": [1.0]}, "scores", "no 2 scores under 'scores'"),
    ],
)
def test_a_crafted_or_malformed_answer_is_one_line_and_runs_nothing(answer, score_key, message):
    server = start_server(answer)
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match=message) as err:
        build(server, score_key=score_key)(images, ["a", "b"], [{}, {}])
    assert "\n" not in str(err.value)
    server.shutdown()


def test_a_failing_server_and_a_missing_one_are_one_line_errors():
    server = start_server({"scores": [1.0, 2.0]})
    server.answer = None
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    reward = build(server)
    server.requests = None  # the handler's append now fails: the server answers 500 with its traceback
    with pytest.raises(RuntimeError, match=r"HTTP 500: AttributeError: 'NoneType' object has no attribute 'append'"):
        reward(images, ["a", "b"], [{}, {}])
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    with pytest.raises(ConnectionError, match=rf"remote_flowgrpo http://127.0.0.1:{port}: no answer"):
        reward(images, ["a", "b"], [{}, {}])
