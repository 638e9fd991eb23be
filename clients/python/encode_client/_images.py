"""Images to bytes and their ``mm_hash``: the exact bytes of the file, never re-encoded, so the
hash equals ``b3sum FILE``. A PIL image has no file bytes; it is saved as PNG (lossless)."""

from __future__ import annotations

import io
import os
from typing import Any, Union

from blake3 import blake3

__all__ = ["ImageInput", "image_bytes", "mm_hash"]

ImageInput = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", Any]
"""Bytes of an image file, a path to one, or a PIL image."""


def mm_hash(data: bytes) -> str:
    """Lowercase hex BLAKE3-256 of the image file's bytes (what ``b3sum`` prints)."""
    return blake3(data).hexdigest()


def image_bytes(image: ImageInput) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image, without importing PIL
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an image is bytes, a path or a PIL image, not {type(image).__name__}")
