"""An adversarial image corpus, generated here with a fixed seed (no binaries from elsewhere),
and the reference decode the server must agree with (DESIGN section 2: first frame, EXIF
orientation applied, RGB; 16-bit grayscale scaled to 8 bits)."""

from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib

import numpy as np
from PIL import Image, ImageOps

from tests.images import bomb_png_header, bomb_webp_header, rgb_image

__all__ = ["corpus", "reference_png"]


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _png_with_size(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 8)) + _chunk(
        b"IEND", b"")


def _gif_bomb(width: int = 50000, height: int = 50000) -> bytes:
    """A GIF whose logical screen and one frame claim 50k x 50k with a few bytes of data."""
    head = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return head + frame + b"\x3b"


def _tiff_bomb() -> bytes:
    data = bytearray(_save(rgb_image(8, 8, seed=3), "TIFF"))
    # Rewrite ImageWidth (256) and ImageLength (257) in the first IFD to 50000.
    ifd = struct.unpack("<I", data[4:8])[0]
    count = struct.unpack("<H", data[ifd:ifd + 2])[0]
    for i in range(count):
        at = ifd + 2 + 12 * i
        tag, kind = struct.unpack("<HH", data[at:at + 4])
        if tag in (256, 257):
            if kind == 3:
                data[at + 8:at + 10] = struct.pack("<H", 50000)
            else:
                data[at + 8:at + 12] = struct.pack("<I", 50000)
    return bytes(data)


def _flip_bits(data: bytes, seed: int, flips: int = 8) -> bytes:
    rng = random.Random(seed)
    out = bytearray(data)
    for _ in range(flips):
        at = rng.randrange(min(len(out), 64), len(out))  # past the signature, mostly
        out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def _exif_rotated(orientation: int) -> bytes:
    image = rgb_image(48, 32, seed=60 + orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(image, "JPEG", exif=exif.tobytes(), quality=90)


def _animated(fmt: str) -> bytes:
    frames = [rgb_image(40, 30, seed=80 + i) for i in range(3)]
    return _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


def _cmyk_jpeg() -> bytes:
    return _save(rgb_image(40, 40, seed=90).convert("CMYK"), "JPEG", quality=90)


def _ycck_jpeg() -> bytes:
    """A CMYK JPEG marked as YCCK by an Adobe APP14 segment (transform = 2)."""
    data = _cmyk_jpeg()
    app14 = b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + struct.pack(">HHHB", 100, 0, 0, 2)
    return data[:2] + app14 + data[2:]


def _png16() -> bytes:
    rng = np.random.default_rng(16)
    return _save(Image.fromarray(rng.integers(0, 65536, (30, 40), dtype=np.uint16)), "PNG")


def _palette_png_with_transparency() -> bytes:
    image = rgb_image(40, 30, seed=17).quantize(16)
    return _save(image, "PNG", transparency=3)


def _la_png() -> bytes:
    rng = np.random.default_rng(18)
    return _save(Image.fromarray(rng.integers(0, 256, (30, 40, 2), dtype=np.uint8), "LA"), "PNG")


def _rgba_png() -> bytes:
    rng = np.random.default_rng(19)
    return _save(Image.fromarray(rng.integers(0, 256, (30, 40, 4), dtype=np.uint8), "RGBA"), "PNG")


def _polyglot() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("payload.txt", "not an image " * 100)
    return _save(rgb_image(40, 40, seed=21), "JPEG") + buf.getvalue()


def corpus() -> dict[str, bytes]:
    """name -> file bytes. Valid oddities, broken files and bombs."""
    base = {fmt: _save(rgb_image(64, 48, seed=30 + i), fmt) for i, fmt in enumerate(("PNG", "JPEG", "GIF", "WEBP",
                                                                                      "TIFF"))}
    cases: dict[str, bytes] = {}
    for fmt, data in base.items():
        cases[f"{fmt.lower()}-valid"] = data
        for cut in (0.1, 0.5, 0.9):
            cases[f"{fmt.lower()}-truncated-{int(cut * 100)}"] = data[: max(1, int(len(data) * cut))]
        for seed in range(3):
            cases[f"{fmt.lower()}-bitflip-{seed}"] = _flip_bits(data, seed)
        cases[f"{fmt.lower()}-header-only"] = data[:32]
    cases |= {
        "png-zero-width": _png_with_size(0, 10),
        "png-zero-height": _png_with_size(10, 0),
        "png-bomb-60k": bomb_png_header(60000, 60000),
        "png-huge-header-2^31": _png_with_size(2**31 - 1, 2**31 - 1),
        "gif-bomb-50k": _gif_bomb(),
        "tiff-bomb-50k": _tiff_bomb(),
        "webp-bomb-16k": bomb_webp_header(),
        "jpeg-cmyk": _cmyk_jpeg(),
        "jpeg-ycck": _ycck_jpeg(),
        "png-16bit-gray": _png16(),
        "png-palette-transparency": _palette_png_with_transparency(),
        "png-la": _la_png(),
        "png-rgba": _rgba_png(),
        "gif-animated": _animated("GIF"),
        "webp-animated": _animated("WEBP"),
        "png-gray": _save(rgb_image(40, 30, seed=22).convert("L"), "PNG"),
        "jpeg-gray": _save(rgb_image(40, 30, seed=23).convert("L"), "JPEG"),
        "png-1x1": _save(rgb_image(1, 1, seed=24), "PNG"),
        "png-1x10000": _save(rgb_image(1, 10000, seed=25), "PNG"),
        "png-10000x1": _save(rgb_image(10000, 1, seed=26), "PNG"),
        "jpeg-zip-polyglot": _polyglot(),
        "empty": b"",
        "text": b"hello, I am not an image",
        "zip": _polyglot()[len(_save(rgb_image(40, 40, seed=21), "JPEG")):],
    }
    for orientation in (3, 6, 8):
        cases[f"jpeg-exif-orientation-{orientation}"] = _exif_rotated(orientation)
    return cases


def reference_png(data: bytes, max_pixels: int) -> bytes | None:
    """What the server must encode, as a plain 8-bit RGB PNG (from Pillow, following the documented
    steps); ``None`` where the file must be refused (unreadable, or above ``max_pixels``)."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in {"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"}:
            return None
        if image.width * image.height > max_pixels or image.width * image.height == 0:
            return None
        image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode.startswith("I;16"):
            array = np.asarray(image, dtype=np.float64)
            image = Image.fromarray(np.round(array / 257).astype(np.uint8), "L")
        return _save(image.convert("RGB"), "PNG")
    except Exception:
        return None
