"""HPSv3 (Ma, Shui et al., ICCV 2025): a Qwen2-VL-7B preference model whose ranknet head reads the hidden state of a
<|Reward|> token and gives (mu, log sigma); the score is mu (unbounded; HPSv3's benchmark means run from -0.2 for
SD2 to 10.6 for Kolors), log sigma is the part `log_sigma`.

The network is transformers' `Qwen2VLModel` built from the base model's config with the checkpoint's weights (the
official checkpoint layout, prompt and image sizing: rewards/_hpsv3_format.py). Preprocessing is torch ops, so the
score is differentiable in the images: bicubic antialiased resize (PIL's kernel; the release resizes 8-bit images with
PIL), CLIP normalisation, patchification.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl.hub import download_file, hub_errors, is_hub_id
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from . import _hpsv3_format as fmt


def _pretrained(cls: Any, name: str, what: str, **kwargs: Any) -> Any:
    if not os.path.isdir(name) and not is_hub_id(name):
        raise FileNotFoundError(
            f"hpsv3: {what} {name!r} is neither a local folder nor a hub id (org/name); pass one of those"
        )
    with hub_errors(name, f"hpsv3: {what}"):
        return cls.from_pretrained(name, **kwargs)


@REWARDS.register("hpsv3")
class HPSv3Reward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ()  # transformers is a core dependency

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = fmt.BASE_MODEL,
        checkpoint: str | None = None,
        min_pixels: int = fmt.PIXELS,
        max_pixels: int = fmt.PIXELS,
    ):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoTokenizer, Qwen2VLModel

        for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hpsv3: {key}={value!r} must be a whole number >= 1 (the release: {fmt.PIXELS})")
        if min_pixels > max_pixels:
            raise ValueError(
                f"hpsv3: min_pixels={min_pixels} exceeds max_pixels={max_pixels}; make min_pixels <= max_pixels"
            )
        self.device, self.dtype, self.min_pixels, self.max_pixels = torch.device(device), dtype, min_pixels, max_pixels
        config = _pretrained(AutoConfig, model_name, "model_name (the Qwen2-VL config)")
        if getattr(config, "model_type", None) != "qwen2_vl":
            raise ValueError(
                f"hpsv3: model_name {model_name!r} is a {getattr(config, 'model_type', None)!r} config, not qwen2_vl; "
                f"pass {fmt.BASE_MODEL} (a local folder or the hub id)"
            )
        self.tokenizer = _pretrained(AutoTokenizer, model_name, "model_name (the Qwen2-VL tokenizer)")
        if len(self.tokenizer) <= 10:
            raise FileNotFoundError(
                f"hpsv3: the tokenizer of {model_name!r} has {len(self.tokenizer)} tokens (an empty download); "
                "pass a complete model folder"
            )
        if fmt.REWARD_TOKEN not in self.tokenizer.get_vocab():  # as the release adds it before training
            self.tokenizer.add_special_tokens({"additional_special_tokens": [fmt.REWARD_TOKEN]})
        self.tokenizer.padding_side = "right"
        self.reward_token_id = self.tokenizer.convert_tokens_to_ids(fmt.REWARD_TOKEN)
        self.image_token_id = config.image_token_id

        if checkpoint is None:  # the HF cache, else a download unless HF_HUB_OFFLINE
            checkpoint = download_file(fmt.REPO, fmt.CHECKPOINT_FILE, "hpsv3: checkpoint")
        text = config.text_config
        backbone, head_state = fmt.split_checkpoint(fmt.read_checkpoint(checkpoint), text.hidden_size, checkpoint)
        rows = backbone["language_model.embed_tokens.weight"].shape[0]
        if rows <= self.reward_token_id:
            raise ValueError(
                f"hpsv3: checkpoint embedding has {rows} rows but {fmt.REWARD_TOKEN} is token {self.reward_token_id} "
                f"of {model_name!r}'s tokenizer; pass the tokenizer the checkpoint was trained with ({fmt.BASE_MODEL})"
            )
        text.vocab_size = rows
        config.vision_config.hidden_size = text.hidden_size  # the merger's output is the language model's input
        with init_empty_weights():  # parameters on meta, filled from the checkpoint; buffers (rotary) computed
            model = Qwen2VLModel(config)
        self._load(model, backbone, checkpoint)
        self.model = model.to(self.device, dtype).eval().requires_grad_(False)
        self.head = fmt.head(text.hidden_size)
        self.head.load_state_dict(head_state)
        self.head = self.head.to(self.device, torch.float64 if dtype == torch.float64 else torch.float32).eval()
        self.head.requires_grad_(False)
        vision = config.vision_config
        self.patch, self.merge, self.temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        self.mean = torch.tensor(fmt.CLIP_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(fmt.CLIP_STD, device=self.device).view(1, 3, 1, 1)

    @staticmethod
    def _load(model: torch.nn.Module, backbone: dict[str, torch.Tensor], path: str) -> None:
        wanted = model.state_dict()
        missing = sorted(set(wanted) - set(backbone))
        unexpected = sorted(set(backbone) - set(wanted))
        if missing or unexpected:
            key, what = (missing[0], "lacks") if missing else (unexpected[0], "has the unknown key")
            raise ValueError(
                f"hpsv3: checkpoint {path!r} {what} {key} ({len(missing)} missing, {len(unexpected)} unknown after "
                f"mapping to Qwen2VLModel); pass {fmt.CHECKPOINT_FILE} from https://huggingface.co/{fmt.REPO} with the "
                f"config of {fmt.BASE_MODEL}"
            )
        for key, value in backbone.items():
            if value.shape != wanted[key].shape:
                raise ValueError(
                    f"hpsv3: checkpoint {key} has shape {tuple(value.shape)} but the config of model_name gives "
                    f"{tuple(wanted[key].shape)}; pass the config the checkpoint was trained from ({fmt.BASE_MODEL})"
                )
        model.load_state_dict(backbone, assign=True)

    def pixels(self, images: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """(normalised images [N, 3, h, w] in the model's dtype, h, w): resized to HPSv3's size for their shape."""
        h, w = fmt.resized_size(*images.shape[-2:], self.patch * self.merge, self.min_pixels, self.max_pixels)
        x = images.to(self.device, torch.float64 if self.dtype == torch.float64 else torch.float32)  # no bf16 resize
        if (h, w) != tuple(x.shape[-2:]):
            x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            x = x.clamp(0, 1)  # PIL's 8-bit output saturates the same way
        return ((x - self.mean.to(x.dtype)) / self.std.to(x.dtype)).to(self.dtype), h, w

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        pixels, h, w = self.pixels(images)
        n, gh, gw = len(prompts), h // self.patch, w // self.patch
        grid = torch.tensor([[1, gh, gw]] * n, device=self.device)  # [N, 3] (frames, rows, columns)
        texts = [fmt.chat_text(prompt, gh * gw // self.merge**2) for prompt in prompts]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        ids = tokens["input_ids"]  # [N, L]
        at_reward, at_image = ids == self.reward_token_id, ids == self.image_token_id  # [N, L]
        wrong = (at_reward.sum(1) != 1) | (at_image.sum(1) != gh * gw // self.merge**2)
        if wrong.any():
            raise ValueError(
                f"hpsv3: prompt {int(wrong.nonzero()[0])} contains {fmt.REWARD_TOKEN} or <|image_pad|>; "
                "remove the token from it"
            )
        vision = self.model.visual(fmt.patches(pixels, self.patch, self.merge, self.temporal), grid_thw=grid)
        image_embeds = vision if isinstance(vision, torch.Tensor) else vision.pooler_output  # [N * tokens, D]
        embeds = self.model.get_input_embeddings()(ids)  # [N, L, D]
        embeds = embeds.masked_scatter(at_image[..., None], image_embeds.to(embeds.dtype))
        hidden = self.model.language_model(
            inputs_embeds=embeds, attention_mask=tokens["attention_mask"], use_cache=False
        )
        hidden = hidden.last_hidden_state  # [N, L, D]; positions 0..L-1 as the release runs it
        out = self.head(hidden[at_reward].to(self.head[0].weight.dtype))  # [N, 2]: mu, log sigma
        return RewardOutput(scores=out[:, 0].float(), parts={"log_sigma": out[:, 1].detach().float()})
