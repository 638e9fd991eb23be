"""Helpers shared by the encoder tests."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from encode_server.encoders.base import EncodedTensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB image with detail everywhere, so any resize or crop error shows."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def decode(encoded: EncodedTensor) -> torch.Tensor:
    """The tensor an ``EncodedTensor``'s bytes hold, as a client would read them."""
    flat = torch.frombuffer(bytearray(encoded.data), dtype=_DTYPES[encoded.dtype])
    return flat.reshape(encoded.shape)


def num_parameters(*modules: torch.nn.Module) -> int:
    return sum(p.numel() for module in modules for p in module.parameters())
