"""Train the artifact reward's classifier backend (rewards/artifact.py) from a folder of labelled images.

    python scripts/train_artifact_reward.py --data DIR --out artifact.safetensors [--epochs 20] [--seed 0]

DIR holds `clean/` and `artifact/` subfolders of PNG/JPEG images. A held-out split (--val-fraction) is scored
at the end; the result is one safetensors file (weights + config + training record in its metadata) that
`artifact` loads with `checkpoint=`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from flowrl.media import IMAGE_SUFFIXES, load_image
from flowrl.rewards.artifact import ArtifactCNN, save_artifact_classifier


def load_labelled(data: str, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> images [M, 3, S, S] in [0, 1], labels [M] float (1 = artifact)."""
    images, labels = [], []
    for label, sub in ((0.0, "clean"), (1.0, "artifact")):
        folder = os.path.join(data, sub)
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"--data {data!r} has no {sub}/ folder; put clean images in clean/ and artifact images in artifact/"
            )
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"{folder!r} holds no images ({', '.join(IMAGE_SUFFIXES)}); add some")
        for name in files:
            image = load_image(os.path.join(folder, name)).unsqueeze(0)  # [1, 3, H, W]
            images.append(
                F.interpolate(image, size=(image_size, image_size), mode="bilinear", antialias=True).clamp(0, 1)
            )
            labels.append(label)
    return torch.cat(images), torch.tensor(labels)


def accuracy(model: ArtifactCNN, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((model(images) > 0).float() == labels).float().mean()) if len(labels) else float("nan")


def train(
    data: str,
    out: str,
    epochs: int = 20,
    batch_size: int = 32,
    lr: float = 3e-3,
    image_size: int = 64,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> dict:
    torch.manual_seed(seed)
    images, labels = load_labelled(data, image_size)
    order = torch.randperm(len(labels))
    num_val = int(len(labels) * val_fraction)
    val, train_idx = order[:num_val], order[num_val:]
    model = ArtifactCNN(image_size=image_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    for _ in range(epochs):
        model.train()
        perm = train_idx[torch.randperm(len(train_idx))]
        for start in range(0, len(perm), batch_size):
            batch = perm[start : start + batch_size]
            x = images[batch]
            x = torch.where(torch.rand(len(batch), 1, 1, 1) < 0.5, x, x.flip(-1))  # horizontal flips
            loss = F.binary_cross_entropy_with_logits(model(x), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    record = {
        "data": os.path.abspath(data),
        "num_train": len(train_idx),
        "num_val": num_val,
        "epochs": epochs,
        "seed": seed,
        "train_accuracy": accuracy(model, images[train_idx], labels[train_idx]),
        "val_accuracy": accuracy(model, images[val], labels[val]),
    }
    save_artifact_classifier(model, out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with clean/ and artifact/ images")
    parser.add_argument("--out", default="artifact.safetensors")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    record = train(
        args.data, args.out, args.epochs, args.batch_size, args.lr, args.image_size, args.val_fraction, args.seed
    )
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
