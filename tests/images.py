"""Test images made on the fly, seeded: real files in every accepted format, and broken ones."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

__all__ = ["bomb_png_header", "image_bytes", "jpeg_without_tables", "rgb_image", "slow_png", "truncated_jpeg"]


def rgb_image(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def image_bytes(fmt: str = "PNG", width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    rgb_image(width, height, seed).save(buf, format=fmt)
    return buf.getvalue()


def truncated_jpeg(seed: int = 0) -> bytes:
    data = image_bytes("JPEG", 128, 128, seed)
    return data[: len(data) // 2]


def jpeg_without_tables(seed: int = 0) -> bytes:
    """A whole JPEG (header, scan, end marker) without its quantization tables: its header reads
    fine, and only decoding it fails (libjpeg: "Quantization table 0x00 was not defined")."""
    data = image_bytes("JPEG", 128, 128, seed)
    out, i = bytearray(data[:2]), 2
    while data[i + 1] != 0xDA:  # segments up to the start of scan
        length = struct.unpack(">H", data[i + 2 : i + 4])[0]
        if data[i + 1] != 0xDB:
            out += data[i : i + 2 + length]
        i += 2 + length
    return bytes(out + data[i:])


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def bomb_png_header(width: int = 60000, height: int = 60000) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` with almost no data: a decompression bomb
    must be refused from its header, before any pixel is decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def bomb_webp_header(width: int = 16384, height: int = 16384) -> bytes:
    """A lossless WebP header (VP8L) claiming ``width`` x ``height`` (16384 is the format's
    maximum) with no data: libwebp would allocate that canvas when the file is opened."""
    bits = (width - 1) | ((height - 1) << 14)
    payload = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def slow_png(seed: int = 0, side: int = 4000) -> bytes:
    """A PNG of one colour, ``side`` x ``side``: tens of KB on the wire, but every one of its
    pixels (16 M by default) is inflated, unfiltered and resized before the model sees it, which
    takes well over 50 ms on any machine. Tests use it to hold an encode in flight without a
    batching window (an idle model runs a lone item at once)."""
    colour = (seed * 37 % 256, seed * 91 % 256, seed * 53 % 256)
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return buf.getvalue()
