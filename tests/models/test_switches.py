"""The memory and speed switches of the `model:` section on tiny real pipelines: prompt cache bound and home,
text-encoder offload, VAE slicing and tiling, compile, TF32, the attention backend."""

import re
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from flowrl.config import ModelConfig
from flowrl.models.prompt_cache import PromptCache
from flowrl.models.switches import apply_switches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prompt_cache_stays_under_its_byte_bound_and_evicts_least_recently_used(tiny_model):
    model = tiny_model("sd3")
    fresh = {p: model.encode([p], guidance_scale=4.5) for p in ("a", "b", "c")}
    entry = PromptCache.size(fresh["a"])  # one prompt with its negative
    model.set_prompt_cache(max_bytes=2 * entry + entry // 2)  # room for two prompts
    calls = []
    original = model.pipe.encode_prompt
    model.pipe.encode_prompt = lambda *a, **k: calls.append(k["prompt"][0]) or original(*a, **k)
    for prompts in (["a", "b"], ["a"], ["c"], ["a", "b"]):  # "b" is least recently used when "c" arrives
        cond = model.encode(prompts, guidance_scale=4.5)
        assert model._cache.nbytes <= model._cache.max_bytes and len(model._cache) <= 2
        for i, p in enumerate(prompts):
            for key, value in fresh[p].items():
                torch.testing.assert_close(cond[key][i : i + 1], value, rtol=0, atol=0)
    assert calls == ["a", "b", "c", "b"]  # "a" stayed (recently used), "b" was evicted and encoded again
    assert model._cache.nbytes == 2 * entry


def test_prompt_cache_on_cpu_and_offloaded_text_encoders(tiny_model):
    model = tiny_model("sd3")
    fresh = model.encode(["a red cat", "a dog"], guidance_scale=4.5)
    cfg = ModelConfig(path="unused", prompt_cache_device="cpu", offload_text_encoders=True)
    apply_switches(model, cfg)
    encoders = [model.pipe.text_encoder, model.pipe.text_encoder_2, model.pipe.text_encoder_3]
    assert set(map(id, model.offloaded)) == set(map(id, encoders))
    again = model.encode(["a red cat", "a dog"], guidance_scale=4.5)
    for key, value in fresh.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0)
    assert all(t.device.type == "cpu" for cond in model._cache._entries.values() for t in cond.values())
    assert all(p.device.type == "cpu" for e in encoders for p in e.parameters())
    model.device = torch.device("meta")  # cached rows are copied to the model's device per batch
    assert {t.device.type for t in model.encode(["a dog"], guidance_scale=4.5).values()} == {"meta"}


def test_prompt_cache_switch_errors(tiny_model):
    with pytest.raises(ValueError, match="model.prompt_cache_device='gpu' must be one of model, cpu"):
        PromptCache(device="gpu")
    with pytest.raises(ValueError, match="model.prompt_cache_max_bytes=-1"):
        PromptCache(max_bytes=-1)
    toy = SimpleNamespace(family="toy", device="cpu")  # no pipeline: the switches do not apply
    apply_switches(toy, ModelConfig())
    with pytest.raises(ValueError, match="model.offload_text_encoders=True does not apply to the toy model"):
        apply_switches(toy, ModelConfig(offload_text_encoders=True))


def test_vae_slicing_decodes_the_same_images_and_reaches_the_vae(tiny_model):
    model = tiny_model("sd3")
    latents = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(0))  # [N, C, H/2, W/2]
    whole = model.decode(latents)
    alone = torch.cat([model.decode(latents[i : i + 1]) for i in range(3)])
    calls = []
    decoder = model.pipe.vae.decoder
    decoder.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    apply_switches(model, ModelConfig(path="unused", vae_slicing=True))
    assert model.pipe.vae.use_slicing
    sliced = model.decode(latents)
    torch.testing.assert_close(sliced, alone, rtol=0, atol=0)  # exactly each sample decoded alone
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6)  # the batched call differs by kernel rounding
    assert calls == [1, 1, 1]  # one sample per decoder call


def test_vae_tiling_decodes_close_images(tiny_model):
    model = tiny_model("sd3")
    latents = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))  # 64x64 images
    whole = model.decode(latents)
    apply_switches(model, ModelConfig(path="unused", vae_tiling=True))
    vae = model.pipe.vae
    assert vae.use_tiling
    calls = []
    vae.decoder.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape[-2:])))
    tiled = model.decode(latents)
    assert len(calls) > 2 and max(calls) <= (16, 16)  # tiles of at most the VAE's sample_size (32 px = 16 latents)
    # a random VAE normalises each tile by its own statistics: measured mean |diff| 0.022, max 0.22 (pixels in [0, 1])
    assert (tiled - whole).abs().mean() < 0.05 and not torch.equal(tiled, whole)


def test_vae_switch_error_names_the_vae(tiny_model):
    model = tiny_model("sd3")
    del model.pipe.vae.use_tiling
    with pytest.raises(
        ValueError, match=r"model.vae_tiling=true: the sd3 VAE \(AutoencoderKL\) has no enable_tiling\(\)"
    ):
        apply_switches(model, ModelConfig(path="unused", vae_tiling=True))


def test_compile_wraps_the_transformer_forward_and_keeps_the_velocity(tiny_model, monkeypatch):
    """Inductor takes about 90 s for the tiny SD3 transformer on a shared 2-core CPU, so the test compiles with the
    "eager" backend: dynamo still traces the forward (LoRA included), and the velocity must not change."""
    model = tiny_model("sd3")
    model.add_lora(rank=4, alpha=4.0)
    cond = model.encode(["a red cat"])
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    before = model.velocity(latents, 0.5, cond, 1.0)
    names = [n for n, _ in model.transformer.named_parameters()]
    calls = []
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: calls.append(kw) or compile_(fn, **{**kw, "backend": "eager"})
    )
    apply_switches(model, ModelConfig(path="unused", compile=True))
    assert len(calls) == 1 and model.transformer._compiled_call_impl is not None
    torch.testing.assert_close(model.velocity(latents, 0.5, cond, 1.0), before, rtol=0, atol=1e-6)
    assert [n for n, _ in model.transformer.named_parameters()] == names  # the same module: LoRA names unchanged


def test_allow_tf32_applies_only_on_cuda(tiny_model):
    model = tiny_model("sd3")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        apply_switches(model, ModelConfig(path="unused"))  # on the CPU: the process-wide flags stay as they were
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        model.device = torch.device("cuda")  # the switch reads only the device type
        apply_switches(model, ModelConfig(path="unused"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        apply_switches(model, ModelConfig(path="unused", allow_tf32=False))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_attention_backend_xformers_names_why_it_cannot_run(tiny_model, monkeypatch):
    model = tiny_model("sd3")
    with pytest.raises(ValueError, match="model.attention_backend='flash' must be one of sdpa, xformers"):
        apply_switches(model, ModelConfig(path="unused", attention_backend="flash"))
    # the pairing here: xformers 0.0.35's kernels were built for torch 2.10 / CUDA 12.8 and do not load beside 2.14.1
    xformers, cpp_lib = ModuleType("xformers"), ModuleType("xformers._cpp_lib")
    xformers.__version__ = "0.0.35"
    cpp_lib._cpp_library_load_exception = SimpleNamespace(build_info=SimpleNamespace(torch_version="2.10.0+cu128"))
    monkeypatch.setitem(sys.modules, "xformers", xformers)
    monkeypatch.setitem(sys.modules, "xformers._cpp_lib", cpp_lib)
    message = (
        "model.attention_backend=xformers: xformers 0.0.35 was built for torch 2.10.0+cu128 and its kernels do not "
        f"load beside torch {torch.__version__}; use attention_backend: sdpa (the default)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_switches(model, ModelConfig(path="unused", attention_backend="xformers"))
    cpp_lib._cpp_library_load_exception = None  # kernels that load still need CUDA
    with pytest.raises(ValueError, match="xformers attention runs on CUDA only, and the model is on cpu"):
        apply_switches(model, ModelConfig(path="unused", attention_backend="xformers"))
    monkeypatch.setitem(sys.modules, "xformers", None)  # not installed (import fails)
    with pytest.raises(ValueError, match=re.escape("xformers is not installed (pip install 'flowrl[cuda]')")):
        apply_switches(model, ModelConfig(path="unused", attention_backend="xformers"))
