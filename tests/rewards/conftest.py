"""Tiny checkpoints for every reward, in the official formats, built in code and saved to a tmp folder.

`REWARD_FACTORIES[name](folder) -> kwargs` builds reward `name`'s tiny weights under `folder` and returns the
config that loads them through the plugin's own loading code.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
TINY_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def tiny_open_clip(folder: Path, seed: int = 0, with_weights: bool = True) -> tuple[str, dict[str, torch.Tensor]]:
    """An open_clip model folder in the hub layout (open_clip_config.json + open_clip_model.safetensors)."""
    import open_clip
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": TINY_CLIP_CFG, "preprocess_cfg": {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic", "resize_mode": "shortest"}}
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if with_weights:
        save_file(state, str(folder / "open_clip_model.safetensors"))
    return str(folder), state


def tiny_clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ".,!?'\"-")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return CLIPTokenizer(vocab=vocab, merges=[])


def tiny_pickscore(folder: Path) -> dict[str, Any]:
    """transformers CLIPModel + CLIPProcessor saved with save_pretrained, as PickScore_v1 is on the hub."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                         image_mean=OPENAI_MEAN, image_std=OPENAI_STD)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, **ids),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    return {"model_name": str(folder), "processor_name": str(folder)}


def tiny_aesthetic_head(path: Path, dims: tuple[int, ...] = (16, 32, 16, 8, 4, 1)) -> dict[str, torch.Tensor]:
    """The improved aesthetic predictor's layout: Linears at layers.0/2/4/6/7 (dropouts between), torch.save'd."""
    torch.manual_seed(1)
    indices = [0, 2, 4, 6, 7][: len(dims) - 1]
    state = {}
    for i, (d_in, d_out) in zip(indices, zip(dims[:-1], dims[1:])):
        state[f"layers.{i}.weight"] = torch.randn(d_out, d_in) / d_in**0.5
        state[f"layers.{i}.bias"] = torch.randn(d_out) * 0.1
    torch.save(state, path)
    return state


def _clipscore(folder: Path) -> dict[str, Any]:
    return {"model_name": tiny_open_clip(folder / "clip")[0], "pretrained": None}


def _hpsv2(folder: Path) -> dict[str, Any]:
    model_dir, state = tiny_open_clip(folder / "clip", seed=3, with_weights=False)
    torch.save({"epoch": 1, "state_dict": state}, folder / "HPS_v2.1_compressed.pt")  # as the HPS release stores it
    return {"model_name": model_dir, "checkpoint": str(folder / "HPS_v2.1_compressed.pt")}


def _aesthetic(folder: Path) -> dict[str, Any]:
    model_dir, _ = tiny_open_clip(folder / "clip")
    tiny_aesthetic_head(folder / "sac+logos+ava1-l14-linearMSE.pth")
    return {"model_name": model_dir, "pretrained": None, "checkpoint": str(folder / "sac+logos+ava1-l14-linearMSE.pth")}


def _temporal(folder: Path) -> dict[str, Any]:
    return {"model_name": tiny_open_clip(folder / "clip")[0], "pretrained": None}


def _ocr(folder: Path) -> dict[str, Any]:
    if shutil.which("tesseract") is None:
        pytest.skip("tesseract binary not installed (apt-get install tesseract-ocr)")
    return {}


def _per_frame(folder: Path) -> dict[str, Any]:
    return {"reward": "clipscore", "reward_config": _clipscore(folder), "reduce": "min", "every_k_frames": 2}


def _remote(folder: Path) -> dict[str, Any]:
    from flowrl.registry import REWARDS
    from flowrl.rewards.reward_server import make_server

    server = make_server(REWARDS.build("jpeg_compressibility"), port=0, token="secret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SERVERS.append(server)
    return {"url": f"http://127.0.0.1:{server.server_address[1]}", "token": "secret", "timeout_s": 10, "max_retries": 0}


_SERVERS: list = []


def _artifact(folder: Path) -> dict[str, Any]:
    from flowrl.rewards.artifact import ArtifactCNN, save_artifact_classifier

    torch.manual_seed(0)
    save_artifact_classifier(ArtifactCNN(image_size=32, channels=(8, 16)), str(folder / "artifact.safetensors"))
    return {"checkpoint": str(folder / "artifact.safetensors")}

REWARD_FACTORIES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "jpeg_compressibility": lambda folder: {},
    "jpeg_incompressibility": lambda folder: {},
    "clipscore": _clipscore,
    "hpsv2": _hpsv2,
    "aesthetic": _aesthetic,
    "pickscore": tiny_pickscore,
    "ocr": _ocr,
    "per_frame": _per_frame,
    "temporal_consistency": _temporal,
    "remote": _remote,
    "artifact": _artifact,
}


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for server in _SERVERS:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tiny_reward_kwargs(tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """kwargs for REWARDS.build(name, ...) that load tiny random weights from tmp_path."""

    def make(name: str) -> dict[str, Any]:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        return REWARD_FACTORIES[name](folder)

    return make
