"""The loader passes the dtype in the form each diffusers version honours: diffusers 0.35-0.39 ignore `dtype=`
("Keyword arguments {'dtype': ...} are not expected ... and will be ignored") and load float32, so they get
`torch_dtype=`; 0.40+ take `dtype=` (and deprecate `torch_dtype`)."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import load_flow_model, pretrained_dtype


@pytest.mark.parametrize(
    "version, keyword",
    [
        ("0.35.0", "torch_dtype"),
        ("0.39.0", "torch_dtype"),
        ("0.40.0", "dtype"),
        ("0.42.1", "dtype"),
        ("0.43.0.dev0", "dtype"),
    ],
)
def test_pretrained_dtype_keyword_per_diffusers_version(monkeypatch, version, keyword):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", version)
    assert pretrained_dtype(torch.bfloat16) == {keyword: torch.bfloat16}


@pytest.mark.parametrize("version, keyword", [("0.39.0", "torch_dtype"), (None, "dtype")])
def test_loader_loads_the_weights_in_the_asked_dtype(tiny_pipeline, monkeypatch, version, keyword):
    import diffusers
    from diffusers import DiffusionPipeline

    if version is not None:  # what the loader passes under an older diffusers (the installed one honours both words)
        monkeypatch.setattr(diffusers, "__version__", version)
    calls = []
    original = DiffusionPipeline.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(dict(kwargs))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(DiffusionPipeline, "from_pretrained", classmethod(spy))
    model = load_flow_model(tiny_pipeline("sd3"), dtype="bfloat16")
    assert {k for k in calls[0] if k in ("dtype", "torch_dtype")} == {keyword} and calls[0][keyword] is torch.bfloat16
    for name in ("transformer", "text_encoder", "vae"):
        assert {p.dtype for p in getattr(model.pipe, name).parameters()} == {torch.bfloat16}, name
