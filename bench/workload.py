"""The benchmark's inputs, seeded: photo-like JPEGs and a Zipf popularity sequence."""

from __future__ import annotations

import bisect
import io
import itertools
import random

import numpy as np
from PIL import Image

__all__ = ["photo_jpeg", "photos", "zipf_sequence"]


_TEXTURE: dict[tuple[int, int], np.ndarray] = {}


def photo_jpeg(seed: int, width: int = 640, height: int = 480, quality: int = 90) -> bytes:
    """A JPEG that compresses like a photo (smooth regions plus texture): about 160 KB at 640x480,
    where pure noise would be three times that and a flat image a tenth."""
    rng = np.random.default_rng(seed)
    if (width, height) not in _TEXTURE:
        _TEXTURE[(width, height)] = np.random.default_rng(0).integers(-28, 29, (height, width, 3), dtype=np.int16)
    coarse = rng.integers(0, 256, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BILINEAR), np.int16)
    texture = np.roll(_TEXTURE[(width, height)], int(rng.integers(0, height)), axis=0)
    pixels = np.clip(smooth + texture, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def photos(first_seed: int, n: int, width: int = 640, height: int = 480) -> list[bytes]:
    """``n`` distinct JPEGs: seeds ``first_seed`` .. ``first_seed + n - 1``."""
    return [photo_jpeg(first_seed + i, width, height) for i in range(n)]


def zipf_sequence(n_items: int, n_requests: int, s: float = 1.0, seed: int = 0) -> list[int]:
    """``n_requests`` draws over ``n_items`` ranks, P(rank k) proportional to 1 / k**s."""
    cumulative = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n_items)))
    rng = random.Random(seed)
    total = cumulative[-1]
    return [min(n_items - 1, bisect.bisect(cumulative, rng.random() * total)) for _ in range(n_requests)]
