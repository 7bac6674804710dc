"""Adv-GRPO's adversarial reward model (docs/recipes/adv_grpo.md): a small head on a frozen vision backbone, trained
during RL to tell reference images (positives) from the policy's samples (negatives), so the reward keeps moving.

    rm = AdversarialReward(cfg.train.adversarial, seed, accelerator)
    rm(images, prompts, metadata)                     # RewardOutput: scores with the RM as it is now (rm.version)
    rm.update(references, generated, index, total)    # one RM step on (reference, generated) pairs, all processes
    schedule_step(schedule, epoch, d_times, ...)      # (update the generator?, update the RM?) this epoch

The DINO head: h = Linear(D→512) → GELU → Linear(512→1), shared by the CLS token and the patch tokens of the backbone;
reward 0.7·h(ĉ) + 0.3·mean_{n∈S} h(p̂_n) over S = 64 patches drawn with replacement, x̂ = x / (‖x‖ + 1e-6); loss the GAN
hinge L_img + 0.3·L_patch. The preference backbone's Bradley–Terry loss (adversarial PickScore) is `preference_loss`.
Backbones: DINOv2 (`transformers.Dinov2Model`, a folder or hub id) on real models; on the Shapes world the frozen trunk
of the toy attribute judge (or the artifact judge), whose 4×4 (8×8) feature map gives the patch tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flowrl.seeds import rm_head_seed, rm_patch_generator
from flowrl.types import RewardOutput

SCHEDULES = ("every_epoch", "every_k_epochs", "gate_ref_below_gen")
TOY_BACKBONES = {"toy_attributes": "attributes", "toy_artifact": "artifact"}
NAME = "adversarial"  # the reward's name among the run's rewards (reward/adversarial/mean)


@dataclass
class AdversarialConfig:
    backbone: str = "toy_attributes"
    """The frozen feature extractor: toy_attributes / toy_artifact (the Shapes world's judges) or a DINOv2 folder or hub
    id (facebook/dinov2-base, Adv-GRPO's ViT-B/14)."""
    image_size: int = 518
    """DINOv2's input side (images resized bicubic; the released code: 518 = 37×37 patches); the toy judges take 32."""
    references: str | None = "world"
    """'world' (each prompt's exact renders in the Shapes world), a JSON file mapping prompt -> image files (paths
    relative to the file), or a folder holding references.json; None: no references (the RM never steps)."""
    schedule: str = "every_epoch"
    """every_epoch (flowrl: a generator update and an RM step every epoch), every_k_epochs (DINO code: the generator on
    epochs with (epoch+1) % d_times == 0, an RM step on the others), gate_ref_below_gen (PickScore code: an RM step and
    no generator update where the references' mean RM reward is below the samples')."""
    d_times: int = 10
    """every_k_epochs' period (the released DINO code: 10)."""
    weight: float = 1.0
    """The weight of reward `adversarial` beside the configured rewards (a 0-weight reward is a monitor)."""
    learning_rate: float = 1e-4
    adam_beta1: float = 0.5
    adam_beta2: float = 0.999
    hidden_size: int = 512
    num_patches: int = 64
    cls_weight: float = 0.7
    """Reward = cls_weight·h(CLS) + (1 − cls_weight)·mean h(patches)."""
    patch_loss_coef: float = 0.3
    normalize_in_update: bool = True
    """Feed the head normalised features in the RM step as in scoring; false reproduces the released code (raw features
    in the update, normalised ones in the reward)."""


def validate(a: AdversarialConfig) -> None:
    """One-line errors naming the field, its value and the fix."""
    if a.schedule not in SCHEDULES:
        raise ValueError(f"train.adversarial.schedule={a.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    positive = ("d_times", "learning_rate", "hidden_size", "num_patches", "image_size")
    for key in positive:
        if getattr(a, key) <= 0:
            raise ValueError(f"train.adversarial.{key}={getattr(a, key)} must be > 0")
    for key in ("cls_weight", "adam_beta1", "adam_beta2"):
        if not 0 <= getattr(a, key) <= 1:
            raise ValueError(f"train.adversarial.{key}={getattr(a, key)} must be in [0, 1]")
    if a.patch_loss_coef < 0 or a.weight < 0:
        raise ValueError(f"train.adversarial.patch_loss_coef={a.patch_loss_coef}, weight={a.weight} must be >= 0")


# ------------------------------------------------------------------------------------------ pure pieces


def schedule_step(
    schedule: str, epoch: int, d_times: int, ref_mean: float = 0.0, gen_mean: float = 0.0
) -> tuple[bool, bool]:
    """(update the generator, take an RM step) at epoch `epoch` (0-based); `ref_mean`/`gen_mean`: the mean RM reward
    of the references and of the samples over every process (gate_ref_below_gen only)."""
    if schedule == "every_epoch":
        return True, True
    if schedule == "every_k_epochs":
        generator = (epoch + 1) % d_times == 0
        return generator, not generator
    if schedule == "gate_ref_below_gen":
        gate = ref_mean < gen_mean
        return not gate, gate
    raise ValueError(f"train.adversarial.schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")


def normalized(x: torch.Tensor) -> torch.Tensor:
    """x / (‖x‖ + 1e-6) over the last dimension (the released code's normalisation)."""
    return x / (x.norm(dim=-1, keepdim=True) + 1e-6)


def head_logits(head: nn.Module, tokens: torch.Tensor, patch_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h(CLS) [N], h(patches) [N, S]) of tokens [N, 1+P, D] (CLS first) at patch indices [N, S] (0..P−1)."""
    cls = head(tokens[:, 0]).squeeze(-1)  # [N]
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
    patches = head(tokens[:, 1:][rows, patch_index]).squeeze(-1)  # [N, S]
    return cls, patches


def head_reward(
    head: nn.Module, tokens: torch.Tensor, patch_index: torch.Tensor, cls_weight: float = 0.7
) -> torch.Tensor:
    """The DINO-head reward [N]: cls_weight·h(ĉ) + (1 − cls_weight)·mean_S h(p̂) on normalised tokens."""
    cls, patches = head_logits(head, normalized(tokens), patch_index)
    return cls_weight * cls + (1 - cls_weight) * patches.mean(1)


def hinge_loss(real: torch.Tensor, fake: torch.Tensor, count: float | None = None) -> torch.Tensor:
    """½[Σ relu(1 − real) + Σ relu(1 + fake)] / count (count = real.numel(): the two means): 0 iff every real logit
    is ≥ 1 and every fake one ≤ −1. A count over every process makes the local sums add up to the global loss."""
    count = real.numel() if count is None else count
    return 0.5 * (torch.relu(1 - real).sum() + torch.relu(1 + fake).sum()) / count


def preference_loss(logit_scale: torch.Tensor | float, cos_gen: torch.Tensor, cos_ref: torch.Tensor) -> torch.Tensor:
    """Adversarial PickScore's RM loss per pair: −log softmax([ℓ·cos_ref, ℓ·cos_gen])_0 = softplus(ℓ·(cos_gen −
    cos_ref)), the reference the preferred image (Bradley–Terry)."""
    return torch.nn.functional.softplus(logit_scale * (cos_gen - cos_ref))


def patch_draw(seed: int, version: int, purpose: int, rows: int, num_tokens: int, num: int) -> torch.Tensor:
    """Patch indices [rows, num] drawn with replacement from 0..num_tokens−1, fixed by (seed, version, purpose):
    the same on every process and on resume."""
    return torch.randint(num_tokens, (rows, num), generator=rm_patch_generator(seed, version, purpose))


# ------------------------------------------------------------------------------------------ backbones


class ToyJudgeBackbone(nn.Module):
    """A frozen Shapes-world judge's conv trunk as tokens [N, 1+P, C]: its last feature map's cells are the patches,
    their mean the CLS token (attribute judge: 4×4 cells of 128 channels; artifact judge: 8×8 of 32)."""

    def __init__(self, kind: str):
        super().__init__()
        from flowrl.toy.judges import load_judge

        self.features = load_judge(kind).features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from flowrl.toy.judges import judge_input

        cells = self.features(judge_input(images, torch.float32) * 2 - 1).flatten(2).transpose(1, 2)  # [N, P, C]
        return torch.cat([cells.mean(1, keepdim=True), cells], 1)


class DinoBackbone(nn.Module):
    """A frozen DINOv2 (transformers) as its last hidden state [N, 1+P, D]: images resized bicubic to `image_size`,
    ImageNet normalisation."""

    def __init__(self, model: str, image_size: int):
        super().__init__()
        from transformers import Dinov2Model

        from flowrl.hub import hub_errors, is_hub_id
        from flowrl.rewards.dino_similarity import IMAGENET_MEAN, IMAGENET_STD  # the dino_similarity reward's input

        if not os.path.isdir(model) and not is_hub_id(model):
            raise FileNotFoundError(
                f"train.adversarial.backbone={model!r} is none of {', '.join(TOY_BACKBONES)}, a local folder or a "
                "hub id"
            )
        with hub_errors(model, "train.adversarial.backbone"):
            self.model = Dinov2Model.from_pretrained(model)
        self.image_size = image_size
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        size = (self.image_size, self.image_size)
        x = torch.nn.functional.interpolate(images.float(), size=size, mode="bicubic", align_corners=False)
        return self.model(pixel_values=(x - self.mean) / self.std).last_hidden_state


class StandInBackbone(nn.Module):
    """`flowrl plan`'s stand-in for a DINOv2 backbone (no weights load): 768-wide tokens of a 2×2 grid, a fixed function
    of the image; the work meter counts its images as the real backbone's."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        cells = torch.nn.functional.adaptive_avg_pool2d(images.float(), 2).flatten(2).transpose(1, 2)  # [N, 4, 3]
        tokens = torch.cat([cells.mean(1, keepdim=True), cells], 1)  # [N, 5, 3]
        return tokens.repeat_interleave(256, dim=-1)  # [N, 5, 768]


def build_backbone(a: AdversarialConfig, device) -> nn.Module:
    from flowrl.training import scoring

    kind = TOY_BACKBONES.get(a.backbone)
    if kind is None and scoring._STAND_IN:  # flowrl plan: no reward model loads
        return StandInBackbone().to(device)
    backbone = ToyJudgeBackbone(kind) if kind is not None else DinoBackbone(a.backbone, a.image_size)
    return backbone.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ the reward model


class AdversarialReward:
    """The RM: scores (a Reward: images, prompts, metadata -> RewardOutput) with the head as it is at `version`, and
    steps on (reference, generated) pairs. Every process holds the same RM at every version: the head starts from
    the run's seed, its gradients are summed over the processes, the patch draws depend on (seed, version) alone."""

    registry_name, modalities, differentiable = NAME, ("image",), False

    def __init__(self, a: AdversarialConfig, seed: int, accelerator):
        validate(a)
        self.cfg, self.seed, self.accelerator = a, seed, accelerator
        self.backbone = build_backbone(a, accelerator.device)
        with torch.no_grad():
            width = self.backbone(torch.zeros(1, 3, 32, 32, device=accelerator.device)).shape[-1]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rm_head_seed(seed))
            head = nn.Sequential(nn.Linear(width, a.hidden_size), nn.GELU(), nn.Linear(a.hidden_size, 1))
        self.head = head.to(accelerator.device, torch.float32)  # fp32 (the code's bf16 Adam loses precision)
        betas = (a.adam_beta1, a.adam_beta2)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=a.learning_rate, betas=betas)
        self.version = 0

    @torch.no_grad()
    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images.to(self.accelerator.device)).float()  # [N, 1+P, D]

    @torch.no_grad()
    def score(self, images: torch.Tensor) -> torch.Tensor:
        """RM rewards [N] at this version: every image on the version's one draw of patches."""
        tokens = self.tokens(images)
        draw = patch_draw(self.seed, self.version, 0, 1, tokens.shape[1] - 1, self.cfg.num_patches).to(tokens.device)
        return head_reward(self.head, tokens, draw.expand(len(tokens), -1), self.cfg.cls_weight)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> RewardOutput:
        return RewardOutput(scores=self.score(images).cpu())

    def update(
        self, references: torch.Tensor, generated: torch.Tensor, index: torch.Tensor, total: int
    ) -> dict[str, float]:
        """One RM step on this process's pairs (references[i], generated[i]); `index` [M]: their places in the step's
        global batch of `total` samples (each image's patch draw). The loss is over every process's pairs, the
        gradients summed over processes, so every process takes the same step. No pair anywhere: no step."""
        a, acc, device = self.cfg, self.accelerator, self.accelerator.device
        count = torch.tensor([float(len(index))], device=device)
        if acc.num_processes > 1:
            count = acc.reduce(count, "sum")
        pairs = int(count.item())
        if pairs == 0:
            return {"train/rm_pairs": 0.0, "train/rm_version": float(self.version)}
        self.optimizer.zero_grad(set_to_none=False)
        for p in self.head.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        stats = {"train/rm_pairs": float(pairs)}
        if len(index):
            logits = []
            for purpose, images in ((1, references), (2, generated)):
                tokens = self.tokens(images)
                tokens = normalized(tokens) if a.normalize_in_update else tokens
                draw = patch_draw(self.seed, self.version, purpose, total, tokens.shape[1] - 1, a.num_patches)
                logits.append(head_logits(self.head, tokens, draw[index.cpu()].to(device)))
            (real_cls, real_patch), (fake_cls, fake_patch) = logits
            loss_img = hinge_loss(real_cls, fake_cls, pairs)
            loss_patch = hinge_loss(real_patch, fake_patch, pairs * a.num_patches)
            (loss_img + a.patch_loss_coef * loss_patch).backward()
            stats |= {"train/rm_loss_img": float(loss_img.detach()), "train/rm_loss_patch": float(loss_patch.detach())}
        if acc.num_processes > 1:
            for p in self.head.parameters():
                torch.distributed.all_reduce(p.grad)  # the sum of the local sums: the global loss's gradient
            for key in ("train/rm_loss_img", "train/rm_loss_patch"):
                stats[key] = float(acc.reduce(torch.tensor([stats.get(key, 0.0)], device=device), "sum"))
        self.optimizer.step()
        self.version += 1
        stats["train/rm_loss"] = stats["train/rm_loss_img"] + a.patch_loss_coef * stats["train/rm_loss_patch"]
        return stats | {"train/rm_version": float(self.version), "train/rm_spread": self.spread()}

    def spread(self) -> float:
        """max − min over the processes of the head's parameter sum (0: every process holds the same RM)."""
        total = torch.stack([p.detach().double().sum() for p in self.head.parameters()]).sum().view(1)
        if self.accelerator.num_processes == 1:
            return 0.0
        every = self.accelerator.gather(total.to(self.accelerator.device))
        return float(every.max() - every.min())

    # ------------------------------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors: the head's weights and Adam's moments, JSON: the version)."""
        tensors = {f"head.{k}": v.detach().clone() for k, v in self.head.state_dict().items()}
        for i, moments in self.optimizer.state_dict()["state"].items():
            tensors |= {f"adam.{i}.{k}": torch.as_tensor(v).clone() for k, v in moments.items()}
        return tensors, {"version": self.version}

    def load(self, tensors: dict[str, torch.Tensor], saved: dict) -> None:
        device = self.accelerator.device
        self.head.load_state_dict({k[5:]: v.to(device) for k, v in tensors.items() if k.startswith("head.")})
        moments: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("adam."):
                _, i, name = key.split(".", 2)
                moments.setdefault(int(i), {})[name] = value.to(device) if name != "step" else value.cpu()
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": moments, "param_groups": groups})
        self.version = int(saved["version"])


# ------------------------------------------------------------------------------------------ reference images


class References:
    """Each prompt's reference images: 'world' renders the Shapes world's scene of the prompt exactly (a fresh seed
    per sample); a JSON file (or a folder holding references.json) maps prompt -> image files. A prompt with none is
    left out of the RM step (counted by the recipe)."""

    def __init__(self, source: str | None):
        from flowrl.training import scoring

        self.source, self.table, self.stand_in = source, {}, source not in (None, "world") and scoring._STAND_IN
        if source not in (None, "world") and not self.stand_in:  # flowrl plan: a grey reference for every prompt
            path = Path(source) / "references.json" if Path(source).is_dir() else Path(source)
            if not path.is_file():
                raise FileNotFoundError(
                    f"train.adversarial.references={source!r} is neither 'world', a JSON file nor a folder holding "
                    "references.json; pass a JSON mapping prompt -> [image files]"
                )
            table = json.loads(path.read_text(encoding="utf-8"))
            self.table = {
                p: [str(path.parent / f) for f in ([fs] if isinstance(fs, str) else fs)] for p, fs in table.items()
            }
        self._loaded: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}  # resized files

    def __call__(
        self, prompts: list[str], keys: list[int], size: tuple[int, int]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """(references [M, 3, H, W] at `size`, the rows of `prompts` they belong to); `keys` [N] pick each row's
        image."""
        images, rows = [], []
        for i, (prompt, key) in enumerate(zip(prompts, keys)):
            image = self._one(prompt, key, size)
            if image is not None:
                images.append(image)
                rows.append(i)
        return (torch.stack(images) if images else None), rows

    def _one(self, prompt: str, key: int, size: tuple[int, int]) -> torch.Tensor | None:
        if self.stand_in:
            return torch.full((3, *size), 0.5)
        if self.source == "world":
            from flowrl.toy.world import parse_prompt, render

            try:
                spec = parse_prompt(prompt)
            except ValueError:
                return None
            image = render(spec, key)
        elif self.table.get(prompt):
            from flowrl.media import load_image

            files = self.table[prompt]
            path = files[key % len(files)]
            if (path, size) not in self._loaded:
                self._loaded[(path, size)] = resized(load_image(path), size)
            return self._loaded[(path, size)]
        else:
            return None
        return resized(image, size)


def resized(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """An image [3, H, W] in [0, 1] at `size` (bicubic, antialiased)."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return torch.nn.functional.interpolate(image[None].float(), size=size, mode="bicubic", antialias=True)[0].clamp(
        0, 1
    )
