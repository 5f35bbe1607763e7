"""Images -> NaViT patches for MoonViT3d (k3-model-spec.md §9.2; transformers' kimi_k25 image
processor is the reference: `navit_resize`, pad, rescale, normalise).

Resize keeping the aspect ratio, never upscaling: with n_h = max(1, H // p), n_w = max(1, W // p),
scale = min(1, sqrt(in_patch_limit / (n_h * n_w)), side * p / H, side * p / W) and the new size
int(H * scale) x int(W * scale) (bicubic); then pad bottom/right with black up to a multiple of
p * merge (28 px) and normalise (x / 255 - mean) / std, so padding is -1. Patches are cut in
raster order: pixel_values [h * w, 3, p, p], grid (1, h, w), tokens (h / 2) * (w / 2).
Decoding (Pillow) refuses what is not one still PNG / JPEG / WebP / GIF frame, or is over the
pixel limit, with a MediaError naming the problem.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class MediaError(ValueError):
    """A media item the server cannot use: the request's fault (400)."""


@dataclass(frozen=True)
class ImageSpec:
    patch_size: int = 14
    merge: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    mean: float = 0.5
    std: float = 0.5
    max_pixels: int = 64_000_000  # decoded width x height refused above this (decompression bombs)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [h * w, 3, p, p] float32
    grid: tuple[int, int, int]  # (1, h, w) patches
    size: tuple[int, int]  # original (width, height)
    digest: str  # sha256 of the decoded pixels: the encoder-cache / prefix-cache key

    @property
    def num_tokens(self) -> int:
        return (self.grid[1] // 2) * (self.grid[2] // 2)


def decode(data: bytes, spec: ImageSpec = ImageSpec()):
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = spec.max_pixels
    try:
        img = Image.open(io.BytesIO(data))
        if img.format not in FORMATS:
            raise MediaError(f"image format {img.format} is not one of PNG, JPEG, WebP, GIF")
        if getattr(img, "n_frames", 1) > 1:
            raise MediaError("animated images are not supported: send one frame (or a video)")
        if img.width * img.height > spec.max_pixels:
            raise MediaError(f"image of {img.width}x{img.height} pixels is over the {spec.max_pixels:,}-pixel limit")
        img.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"image cannot be decoded ({type(e).__name__}: {e})") from None
    except Image.DecompressionBombError as e:
        raise MediaError(f"image is over the pixel limit ({e})") from None
    return img.convert("RGB")


def target_size(width: int, height: int, spec: ImageSpec = ImageSpec()) -> tuple[int, int]:
    """(width, height) after the NaViT resize (before padding)."""
    p, side = spec.patch_size, spec.patch_limit_on_one_side
    n_h, n_w = max(1, height // p), max(1, width // p)
    scale = min(1.0, math.sqrt(spec.in_patch_limit / (n_h * n_w)), side * p / height, side * p / width)
    return min(side * p, max(1, int(width * scale))), min(side * p, max(1, int(height * scale)))


def preprocess(img, spec: ImageSpec = ImageSpec()) -> ProcessedImage:
    from PIL import Image

    w0, h0 = img.size
    w, h = target_size(w0, h0, spec)
    if (w, h) != (w0, h0):
        img = img.resize((w, h), Image.BICUBIC)
    unit = spec.patch_size * spec.merge
    pw, ph = -(-w // unit) * unit, -(-h // unit) * unit
    arr = np.zeros((ph, pw, 3), dtype=np.float32)
    arr[:h, :w] = np.asarray(img, dtype=np.float32)
    arr = (arr / 255.0 - spec.mean) / spec.std
    p = spec.patch_size
    gh, gw = ph // p, pw // p
    patches = torch.from_numpy(arr).view(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    digest = hashlib.sha256(np.asarray(img).tobytes() + f"{w0}x{h0}".encode()).hexdigest()
    return ProcessedImage(patches.contiguous(), (1, gh, gw), (w0, h0), digest)


def load_image(data: bytes, spec: ImageSpec = ImageSpec()) -> ProcessedImage:
    return preprocess(decode(data, spec), spec)
