"""A tiny random LTX-2 pipeline (LTX2Pipeline), built offline for flowrl.models.tiny.

Gemma-3 from a config (2 text layers of width 16 and a 1-layer SigLIP tower, which text-to-video never runs) behind
the character-level Gemma tokenizer of tiny_tokenizers.py; the text connectors (8 learnable registers, so prompts
pad to a multiple of 8 tokens); a 1-layer joint video/audio transformer (with LTX-2.3's perturbable self-attention,
which spatio-temporal guidance needs); a 1-block video VAE (2x spatial and temporal compression: 32x32x5 frames ->
4 x 3 x 16 x 16 latents), the audio VAE (8 mel bins) and vocoder; and
LTX-2's scheduler settings (exponential dynamic shift over the video token count, terminal σ 0.1). Both VAEs carry
latent statistics away from (0, 1), so the adapter's normalisation is exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.tiny_tokenizers import gemma_tokenizer


def _tiny_gemma3(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    pad, eos, bos, unk = tokenizer.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>"])
    text = {"vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2}
    return Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config={
                **text,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "max_position_embeddings": 2048,
                "sliding_window": 64,
                "pad_token_id": pad,
                "eos_token_id": eos,
                "bos_token_id": bos,
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 32,
                "patch_size": 8,
            },
            mm_tokens_per_image=4,
            boi_token_index=unk,  # no image tokens in text-to-video prompts
            eoi_token_index=unk,
            image_token_index=unk,
        )
    )


def build_ltx2(folder: Path) -> Path:
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    tokenizer = gemma_tokenizer()
    text_encoder = _tiny_gemma3(tokenizer)
    width, layers = 16, text_encoder.config.text_config.num_hidden_layers
    connector = {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1, "num_learnable_registers": 8}
    connectors = LTX2TextConnectors(
        caption_channels=width,
        text_proj_in_factor=layers + 1,  # the pipeline stacks every hidden state (embeddings included)
        **{f"video_connector_{k}": v for k, v in connector.items()},
        **{f"audio_connector_{k}": v for k, v in connector.items()},
        connector_rope_base_seq_len=64,
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,  # 2 latent channels x 2 latent mel bins
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=1,
        caption_channels=width,
        perturbed_attn=True,  # LTX-2.3's layout: spatio-temporal guidance can skip a block's self-attention
    )
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        patch_size=1,
        patch_size_t=1,
        decoder_causal=False,
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,  # also the width of its latent statistics: one per packed audio channel
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        mel_bins=8,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
        vae.latents_std.copy_(torch.tensor([1.5, 0.8, 1.2, 2.0]))
        audio_vae.latents_mean.copy_(torch.tensor([0.05, -0.1, 0.2, 0.0]))
        audio_vae.latents_std.copy_(torch.tensor([1.2, 0.9, 1.1, 1.5]))
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
        hidden_channels=8,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=16000,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-2's scheduler settings
        base_image_seq_len=1024,
        base_shift=0.95,
        max_image_seq_len=4096,
        max_shift=2.05,
        shift_terminal=0.1,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(folder)
    return folder
