"""LTX-2 text-to-video (LTX2Pipeline): one transformer denoising video and audio latents jointly, Gemma-3 text
encoder behind the pipeline's text connectors.

flowrl's state is one flat vector per sample, [N, D]: the pipeline's packed video tokens [Lv, Cv] followed by its
packed audio tokens [La, Ca], both in the pipeline's normalised latent space (docs/models.md#ltx-2). `velocity`
splits the vector, makes the pipeline's one joint transformer call (both modalities at the sample's timestep, as
the pipeline feeds them in text-to-video) and returns both predictions concatenated the same way, so the samplers,
the SDE step and the log-probs treat the pair as one latent. Guidance is the pipeline's: CFG in x0 space, per
modality with its own scale (`audio_guidance_scale`, None = the video scale), then the guidance rescale of each
modality (`guidance_rescale`, `audio_guidance_rescale`); the pipeline's spatio-temporal guidance (`stg_scale`, one
more call with the self-attention of `stg_blocks` skipped, which only checkpoints with `perturbed_attn` have) and
modality-isolation guidance (`modality_scale`, one more call without the audio-video cross-attention) on request.
The defaults are plain CFG: the pipeline's own defaults (STG 1 at block 28, modality 3, rescale 0.7, audio CFG 7)
are its LTX-2.3 recommendations and cost two more transformer calls per step.

`decode` gives the video frames [N, F, 3, H, W] in [0, 1] to the rewards; the audio stays in the state and
`decode_audio` turns it into the vocoder's waveform on request.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


def rescale_guidance(guided: torch.Tensor, conditional: torch.Tensor, rescale: float) -> torch.Tensor:
    """The guidance rescale of "Common Diffusion Noise Schedules and Sample Steps are Flawed" (§3.4), per sample:
    the guided prediction scaled to the conditional one's standard deviation (over all but the batch dimension),
    mixed back with weight `rescale`."""
    dims = tuple(range(1, guided.ndim))
    matched = guided * (conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * matched + (1 - rescale) * guided


class LTX2FlowModel(PipelineFlowModel):
    family = "ltx2"
    is_video = True
    max_sequence_length = 1024  # the pipeline's default
    default_guidance_scale = 3.0  # the pipeline's default (video CFG)
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")  # every attention of the joint transformer

    def __init__(
        self,
        pipe,
        device="cpu",
        dtype=torch.float32,
        frame_rate: float = 24.0,
        guidance_rescale: float = 0.0,
        audio_guidance_scale: float | None = None,
        audio_guidance_rescale: float | None = None,
        stg_scale: float = 0.0,
        audio_stg_scale: float | None = None,
        stg_blocks: list[int] | tuple[int, ...] = (),
        modality_scale: float = 1.0,
        audio_modality_scale: float | None = None,
    ):
        super().__init__(pipe, device, dtype)
        if not (isinstance(frame_rate, (int, float)) and frame_rate > 0):
            raise ValueError(
                f"model.family_kwargs.frame_rate={frame_rate!r} must be a positive number of frames per second "
                "(e.g. 24)"
            )
        for name, value in (("guidance_rescale", guidance_rescale), ("audio_guidance_rescale", audio_guidance_rescale)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"model.family_kwargs.{name}={value!r} must be in [0, 1] (0: no rescale)")
        if audio_guidance_scale is not None and audio_guidance_scale < 0:
            raise ValueError(
                f"model.family_kwargs.audio_guidance_scale={audio_guidance_scale!r} must be >= 0 "
                "(or None: the video scale)"
            )
        for name, value in (
            ("stg_scale", stg_scale),
            ("audio_stg_scale", audio_stg_scale),
            ("modality_scale", modality_scale),
            ("audio_modality_scale", audio_modality_scale),
        ):
            if value is not None and value < 0:
                raise ValueError(f"model.family_kwargs.{name}={value!r} must be >= 0")
        self.stg_scales = (float(stg_scale), float(stg_scale if audio_stg_scale is None else audio_stg_scale))
        self.modality_scales = (
            float(modality_scale),
            float(modality_scale if audio_modality_scale is None else audio_modality_scale),
        )
        layers = len(self.transformer.transformer_blocks)
        self.stg_blocks = [int(b) for b in stg_blocks]
        if max(self.stg_scales) > 0 and not self.stg_blocks:
            raise ValueError(
                "model.family_kwargs.stg_scale > 0 needs stg_blocks, the blocks whose self-attention STG skips "
                "(e.g. [28])"
            )
        if max(self.stg_scales) > 0 and not self.transformer.config.perturbed_attn:
            raise ValueError(
                "model.family_kwargs.stg_scale > 0 but the transformer has perturbed_attn=False (LTX-2.0), where STG "
                "changes nothing; set stg_scale to 0"
            )
        if any(not 0 <= b < layers for b in self.stg_blocks):
            raise ValueError(
                f"model.family_kwargs.stg_blocks={list(stg_blocks)} must index the transformer's {layers} blocks "
                f"(0 to {layers - 1})"
            )
        self.frame_rate = float(frame_rate)
        self.guidance_rescale = float(guidance_rescale)
        self.audio_guidance_scale = audio_guidance_scale
        self.audio_guidance_rescale = (
            self.guidance_rescale if audio_guidance_rescale is None else float(audio_guidance_rescale)
        )
        self._layouts: dict[int, tuple[int, int, int, int]] = {}  # D -> (F', H', W', audio frames)

    # ----------------------------------------------------------------------------------------- prompts
    def set_max_sequence_length(self, length: int) -> None:
        registers = [
            r
            for r in (
                self.pipe.connectors.config.video_connector_num_learnable_registers,
                self.pipe.connectors.config.audio_connector_num_learnable_registers,
            )
            if r
        ]
        if isinstance(length, int) and any(length % r for r in registers):
            r = math.lcm(*registers)
            raise ValueError(
                f"model.max_sequence_length={length} must be a multiple of the LTX-2 text connectors' {r} learnable "
                f"registers (e.g. {max(r, length // r * r)})"
            )
        super().set_max_sequence_length(length)

    def _audio_scale(self, guidance_scale: float) -> float:
        return guidance_scale if self.audio_guidance_scale is None else self.audio_guidance_scale

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 or self._audio_scale(guidance_scale) > 1.0  # the pipeline's rule: either modality

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        cfg = negative_prompt is not None
        embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        side = getattr(self.pipe.tokenizer, "padding_side", "left")

        def connected(prefix, e, m):  # the text connectors' video and audio streams and their mask, [1, L, D]
            video, audio, connector_mask = self.pipe.connectors(e, m, padding_side=side)
            return {
                f"{prefix}prompt_embeds": video,
                f"{prefix}audio_prompt_embeds": audio,
                f"{prefix}attention_mask": connector_mask,
            }

        cond = connected("", embeds, mask)
        if cfg:
            cond.update(connected("negative_", neg_embeds, neg_mask))
        return cond

    # ----------------------------------------------------------------------------------------- latents
    @property
    def native_size(self) -> tuple[int, int, int | None]:
        return 512, 768, 121  # LTX2Pipeline's defaults

    @property
    def noise_dtype(self) -> torch.dtype:
        return torch.float32  # the pipeline draws both noises in float32

    def size_factor(self) -> int:
        # the pipeline refuses sizes that are not multiples of 32, whatever the VAE's factor
        return math.lcm(32, self.pipe.vae_spatial_compression_ratio * self.pipe.transformer_spatial_patch_size)

    def check_size(self, height, width, num_frames=None):
        super().check_size(height, width)
        tf = self.pipe.vae_temporal_compression_ratio
        if num_frames is None or num_frames < 1 or (num_frames - 1) % tf:
            raise ValueError(f"num_frames={num_frames} must be 1 + a multiple of {tf} for LTX-2 (e.g. {2 * tf + 1})")
        if self._audio_frames(num_frames) < 1:
            raise ValueError(
                f"num_frames={num_frames} at frame_rate={self.frame_rate:g} gives no audio latent frame; "
                "use more frames"
            )

    def _audio_frames(self, num_frames: int) -> int:
        """Audio latent frames of a clip, as the pipeline counts them (duration x audio latents per second)."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(num_frames / self.frame_rate * per_second)

    def _grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int, int]:
        """(latent frames, latent height, latent width, audio latent frames) of a clip."""
        pipe = self.pipe
        s, t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        return (num_frames - 1) // t + 1, height // s, width // s, self._audio_frames(num_frames)

    def _token_shapes(self, layout: tuple[int, int, int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """(video tokens, channels) and (audio tokens, channels) of the packed latents of a layout."""
        f, h, w, a = layout
        config = self.transformer.config
        p, pt = config.patch_size, config.patch_size_t
        video = ((f // pt) * (h // p) * (w // p), config.in_channels * p * p * pt)
        audio_vae = self.pipe.audio_vae.config
        audio = (a, audio_vae.latent_channels * (audio_vae.mel_bins // self.pipe.audio_vae_mel_compression_ratio))
        return video, audio

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is None:
            raise ValueError("num_frames is required for LTX-2 video models")
        layout = self._grid(height, width, num_frames)
        (lv, cv), (la, ca) = self._token_shapes(layout)
        size = lv * cv + la * ca
        if self._layouts.setdefault(size, layout) != layout:
            raise ValueError(
                f"{height}x{width}x{num_frames} gives a {size}-value LTX-2 state like the size "
                f"{self._layouts[size]} already in use; run one of the two sizes per model"
            )
        return (size,)  # [video tokens x channels, then audio tokens x channels]

    def image_seq_len(self, height, width, num_frames=None):
        return self._token_shapes(self._grid(height, width, num_frames))[0][0]  # the video tokens (the pipeline's μ)

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()

    def _noise_shape(self, num, height, width, num_frames):
        raise NotImplementedError("LTX-2 draws two noises; see prepare_latents")

    def prepare_latents(self, num, height, width, generator=None, num_frames=None) -> torch.Tensor:
        """The pipeline's initial noise: video latents, then audio latents from the same generators (float32)."""
        from diffusers.utils.torch_utils import randn_tensor

        self.check_size(height, width, num_frames)
        self.latent_shape(height, width, num_frames)
        pipe = self.pipe
        f, h, w, a = self._grid(height, width, num_frames)
        config = self.transformer.config
        video = randn_tensor(
            (num, config.in_channels, f, h, w), generator=generator, device=self.device, dtype=torch.float32
        )
        video = pipe._pack_latents(video, config.patch_size, config.patch_size_t)  # [N, Lv, Cv]
        audio_vae = pipe.audio_vae.config
        shape = (num, audio_vae.latent_channels, a, audio_vae.mel_bins // pipe.audio_vae_mel_compression_ratio)
        audio = pipe._pack_audio_latents(
            randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
        )
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)  # [N, D]

    def split_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A state [N, D] -> its packed video tokens [N, Lv, Cv] and audio tokens [N, La, Ca] (views)."""
        (lv, cv), (la, ca) = self._token_shapes(self._layout(latents))
        return latents[:, : lv * cv].unflatten(1, (lv, cv)), latents[:, lv * cv :].unflatten(1, (la, ca))

    def _layout(self, latents: torch.Tensor) -> tuple[int, int, int, int]:
        size = latents.shape[-1]
        if size not in self._layouts:
            raise ValueError(
                f"an LTX-2 state of {size} values has no known size; call latent_shape(height, width, num_frames) first"
            )
        return self._layouts[size]

    # ----------------------------------------------------------------------------------------- network
    def velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor | float, cond: Cond, guidance_scale: float
    ) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(latents.shape[0])
        with self.autocast():  # the guidance arithmetic stays in float32, as in the pipeline
            return self._velocity(latents.float(), sigma, cond, guidance_scale)

    def _forward(self, video, audio, timestep, embeds, audio_embeds, mask, layout, stg_blocks=None, isolate=False):
        f, h, w, a = layout
        n, device = video.shape[0], video.device
        transformer = self.transformer
        video_coords = transformer.rope.prepare_video_coords(n, f, h, w, device, fps=self.frame_rate)
        audio_coords = transformer.audio_rope.prepare_audio_coords(n, a, device)
        dtype = transformer.dtype
        v_video, v_audio = transformer(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=embeds,
            audio_encoder_hidden_states=audio_embeds,
            timestep=timestep,
            sigma=timestep,  # both modalities at the sample's time (LTX-2.3 also reads it as `sigma`)
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=f,
            height=h,
            width=w,
            fps=self.frame_rate,
            audio_num_frames=a,
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=isolate,  # modality-isolation guidance: no audio-video cross-attention
            spatio_temporal_guidance_blocks=stg_blocks,  # STG: these blocks' self-attention skipped
            perturbation_mask=None,
            use_cross_timestep=True,
            return_dict=False,
        )
        return v_video.float(), v_audio.float()

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        layout = self._layout(latents)
        video, audio = self.split_latents(latents)
        timestep = timesteps_from_sigmas(sigma)  # [N]
        keys = ("prompt_embeds", "audio_prompt_embeds", "attention_mask")
        text = [cond[k] for k in keys]
        cfg = self.uses_cfg(guidance_scale)
        stg, modality = max(self.stg_scales) > 0, max(self.modality_scales) > 1
        if not (cfg or stg or modality):
            v_video, v_audio = self._forward(video, audio, timestep, *text, layout)
            return torch.cat([v_video.flatten(1), v_audio.flatten(1)], dim=1)
        if bool((sigma <= 0).any()):
            raise ValueError("LTX-2 guidance runs in x0 space (x0 = x - σ·v, then back through 1/σ): call it at σ > 0")
        # the pipeline's guidance, in x0 space: each term adds scale x (conditional - weaker prediction)
        terms = []  # (scales (video, audio), weaker x0 predictions (video, audio))
        if cfg:  # one call over [negative; prompt], as the pipeline batches it
            both = [torch.cat([cond[f"negative_{k}"], cond[k]]) for k in keys]
            out = self._forward(video.repeat(2, 1, 1), audio.repeat(2, 1, 1), timestep.repeat(2), *both, layout)
            uncond, conditional = zip(*(v.chunk(2) for v in out))
            scales = (guidance_scale, self._audio_scale(guidance_scale))
            terms.append(([s - 1 for s in scales], uncond))
        else:
            conditional = self._forward(video, audio, timestep, *text, layout)
        if stg:
            terms.append(
                (self.stg_scales, self._forward(video, audio, timestep, *text, layout, stg_blocks=self.stg_blocks))
            )
        if modality:
            terms.append(
                (
                    [s - 1 for s in self.modality_scales],
                    self._forward(video, audio, timestep, *text, layout, isolate=True),
                )
            )
        s = sigma.view(-1, 1, 1)
        rescales = (self.guidance_rescale, self.audio_guidance_rescale)
        out = []
        for m, (x, v, rescale) in enumerate(zip((video, audio), conditional, rescales)):
            x0 = x - v * s
            guided = x0
            for scales, weaker in terms:  # in the pipeline's order: CFG, STG, modality isolation
                guided = guided + scales[m] * (x0 - (x - weaker[m] * s))
            if rescale > 0:
                guided = rescale_guidance(guided, x0, rescale)
            out.append(((x - guided) / s).flatten(1))  # back to a velocity
        return torch.cat(out, dim=1)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Video frames [N, F, 3, H, W] in [0, 1] of states [N, D] (the pipeline's decode at decode_timestep 0)."""
        pipe, vae = self.pipe, self.pipe.vae
        f, h, w, _ = self._layout(latents)
        video, _ = self.split_latents(latents)
        config = self.transformer.config
        # [N, C, F', H', W']
        video = pipe._unpack_latents(video.float(), f, h, w, config.patch_size, config.patch_size_t)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        # a timestep-conditioned decoder gets decode_timestep 0 (the pipeline's default, which adds no noise)
        timestep = (
            torch.zeros(video.shape[0], device=video.device, dtype=vae.dtype)
            if vae.config.timestep_conditioning
            else None
        )
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]  # [N, 3, F, H, W]
        return (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

    @property
    def audio_sample_rate(self) -> int:
        """Samples per second of `decode_audio`'s waveforms (the vocoder's output rate)."""
        return int(self.pipe.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """The audio of states [N, D] as the pipeline decodes it: audio VAE to a mel spectrogram, then the vocoder's
        waveform [N, channels, samples] at `audio_sample_rate`."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        _, _, _, a = self._layout(latents)
        _, audio = self.split_latents(latents)
        audio = pipe._denormalize_audio_latents(audio.float(), audio_vae.latents_mean, audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, a, num_mel_bins=mel_bins)  # [N, C, La, M]
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel).float()
