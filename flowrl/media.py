"""Image and video files <-> float tensors in [0, 1]: PNG/JPEG images, GIF/MP4 videos, folders of frames,
and PNG bytes for the remote reward protocol.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch
from PIL import Image, ImageSequence

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".gif", ".mp4", ".webm", ".mov")


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """A PIL image as [3, H, W] float32 RGB in [0, 1]."""
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)  # [H, W, 3]
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0  # [3, H, W]


def load_image(path: str) -> torch.Tensor:
    """One image file as [3, H, W] float32 in [0, 1]."""
    if os.path.isdir(path):
        raise ValueError(f"image file {path!r} is a folder; pass PNG/JPEG files (a folder of frames is a video)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image file {path!r} does not exist; pass an existing PNG or JPEG")
    try:
        with Image.open(path) as image:
            return pil_to_tensor(image)
    except OSError as err:  # PIL.UnidentifiedImageError (not an image), a truncated or unsupported file
        raise ValueError(
            f"image file {path!r} is not a readable image ({' '.join(str(err).split())}); "
            f"pass a PNG or JPEG ({', '.join(IMAGE_SUFFIXES)})"
        ) from None


def _stack(tensors: list[torch.Tensor], paths: list[str], what: str) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"{what} have different sizes {sorted(shapes)} ({paths[0]} ...); resize them to one size or score them "
            "separately"
        )
    return torch.stack(tensors)


def load_images(paths: list[str]) -> torch.Tensor:
    """Image files of one size as [N, 3, H, W] float32 in [0, 1]."""
    return _stack([load_image(p) for p in paths], paths, "images")


def load_video(path: str) -> torch.Tensor:
    """A GIF/MP4 file or a folder of frame images (sorted by name) as [F, 3, H, W] float32 in [0, 1]."""
    if os.path.isdir(path):
        frames = sorted(os.path.join(path, f) for f in os.listdir(path) if f.lower().endswith(IMAGE_SUFFIXES))
        if not frames:
            raise FileNotFoundError(
                f"video folder {path!r} holds no frame images ({', '.join(IMAGE_SUFFIXES)}); put the frames there"
            )
        return _stack([load_image(f) for f in frames], frames, "frames")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video {path!r} does not exist; pass a GIF/MP4 file or a folder of frames")
    if path.lower().endswith(".gif"):
        with Image.open(path) as gif:
            return torch.stack([pil_to_tensor(frame) for frame in ImageSequence.Iterator(gif)])  # [F, 3, H, W]
    if path.lower().endswith(VIDEO_SUFFIXES):
        import imageio.v3 as iio

        array = iio.imread(path, plugin="FFMPEG" if _has_ffmpeg() else None)  # [F, H, W, 3] uint8
        return torch.from_numpy(np.ascontiguousarray(array[..., :3])).permute(0, 3, 1, 2).float() / 255.0
    raise ValueError(f"video {path!r} has an unknown suffix; use one of {VIDEO_SUFFIXES} or a folder of frames")


def load_videos(paths: list[str]) -> torch.Tensor:
    """Videos of one size and length as [N, F, 3, H, W] float32 in [0, 1]."""
    return _stack([load_video(p) for p in paths], paths, "videos")


def _has_ffmpeg() -> bool:
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[..., 3, H, W] in [0, 1] -> uint8, rounded as PIL and DDPO do."""
    return (images.detach() * 255).round().clamp(0, 255).to(torch.uint8)


def encode_pngs(images: torch.Tensor) -> list[bytes]:
    """[N, 3, H, W] in [0, 1] -> N PNG byte strings (8-bit, so values are rounded to k/255); the uint8 conversion is
    done once for the whole batch."""
    pixels = to_uint8(images).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # [N, H, W, 3]
    out = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG", compress_level=1)
        out.append(buffer.getvalue())
    return out


def decode_png(data: bytes) -> torch.Tensor:
    """PNG bytes -> [3, H, W] float32 in [0, 1]."""
    with Image.open(io.BytesIO(data)) as image:
        return pil_to_tensor(image)


def save_image(image: torch.Tensor, path: str) -> str:
    """[3, H, W] in [0, 1] -> a PNG file."""
    Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy()).save(path)
    return path


def save_video(video: torch.Tensor, path_stem: str, fps: int = 8) -> str:
    """[F, 3, H, W] in [0, 1] -> MP4 (imageio-ffmpeg present), else an animated GIF; returns the path written."""
    frames = [to_uint8(f).permute(1, 2, 0).cpu().numpy() for f in video]
    if _has_ffmpeg():
        import imageio.v2 as imageio

        path = path_stem + ".mp4"
        # macro_block_size=1 keeps odd sizes (tiny test videos) as they are
        imageio.mimwrite(path, frames, fps=fps, macro_block_size=1)
        return path
    path = path_stem + ".gif"
    pil = [Image.fromarray(f) for f in frames]
    pil[0].save(path, save_all=True, append_images=pil[1:], duration=int(1000 / fps), loop=0)
    return path


def save_strip(video: torch.Tensor, path: str) -> str:
    """[F, 3, H, W] in [0, 1] -> one PNG with the frames side by side."""
    return save_image(torch.cat(list(video), dim=-1), path)


def save_gif(video: torch.Tensor, path: str, fps: int = 8) -> str:
    """[F, 3, H, W] in [0, 1] -> an animated GIF that loops (what browsers animate inside <img>)."""
    frames = [Image.fromarray(to_uint8(f).permute(1, 2, 0).cpu().numpy()) for f in video]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path
