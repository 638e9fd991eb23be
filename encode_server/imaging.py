"""Bytes to an RGB image, safely: size checked from the header before any pixel is decoded.

Runs in the preprocessing worker pool. Every failure is a ``BadInput`` or ``TooLarge`` naming the
item, never a bare Pillow exception: bad bytes are the client's problem, not a 500.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from encode_server.core.errors import BadInput, TooLarge
from encode_server.core.sniff import other_modality_hint
from encode_server.core.types import IMAGE

__all__ = [
    "ACCEPTED_FORMATS", "Header", "decode_image", "decoded_nbytes", "open_image", "oriented_size", "probe_size",
    "read_header", "to_rgb",
]

# 16-bit grayscale (PNG, TIFF): Pillow's convert("RGB") clips each sample at 255, so all but the
# darkest 1/256 of the range turns white. Scale to 8 bits first, as every viewer does.
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})

# Our own --max-image-pixels check does the work, from the header, before any pixel is decoded
# (``_open``, on every path to the pixels): Pillow's own limit is off, so that an image above it
# (~179 MP) is refused with our limit's message, and a --max-image-pixels above it holds.
Image.MAX_IMAGE_PIXELS = None

# Formats the contract accepts. Pillow opens more (ICO, PSD, PCX, EPS...), which we refuse as
# ``unsupported_image`` rather than feed oddities to the model. MPO is how Pillow names a JPEG
# with embedded previews (many phone cameras).
ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"})


def _webp_canvas(data: bytes) -> tuple[int, int] | None:
    """A WebP's canvas (width, height) from its first chunk header; None when not a WebP or unsaid.

    Pillow hands a WebP to libwebp when it opens it, and libwebp allocates the whole canvas then
    (16384 x 16384 x 4 = 1 GiB for a 40-byte file). Pillow's own limit, which we turn off, was the
    only check before that, so the size is read and checked here first.
    """
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: 24-bit canvas width - 1 and height - 1
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8L" and data[20] == 0x2F:  # lossless: 14 bits each, minus one
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":  # lossy key frame: 14 bits each
        return (int.from_bytes(data[26:28], "little") & 0x3FFF), (int.from_bytes(data[28:30], "little") & 0x3FFF)
    return None


def _check_pixels(width: int, height: int, index: int | None, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise TooLarge(
            f"image is {width}x{height} = {width * height} pixels, above the limit of {max_pixels} "
            "(--max-image-pixels)",
            type="image_too_large",
            index=index,
        )


def open_image(data: bytes | Image.Image, *, max_pixels: int, index: int | None = None) -> Image.Image:
    """``data``'s header, checked (format, size) and nothing decoded; an image already opened so is
    handed back as it is. Opening once for the memory charge and the decode halves Pillow's header
    parsing, which runs in Python under the GIL (about 0.1 ms a JPEG)."""
    return data if isinstance(data, Image.Image) else _open(data, index, max_pixels)


def _open(data: bytes, index: int | None, max_pixels: int) -> Image.Image:
    if not data:
        raise BadInput("empty image (0 bytes)", type="invalid_image", index=index)
    if canvas := _webp_canvas(data):
        _check_pixels(*canvas, index, max_pixels)
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        hint = other_modality_hint(data, IMAGE)
        raise BadInput(f"not a recognised image file{hint}", type="invalid_image", index=index) from exc
    except Exception as exc:  # Pillow raises many types on malformed headers
        raise BadInput(f"cannot read image header: {exc}", type="invalid_image", index=index) from exc
    if image.format not in ACCEPTED_FORMATS:
        raise BadInput(
            f"unsupported image format {image.format}; accepted: {', '.join(sorted(ACCEPTED_FORMATS))}",
            type="unsupported_image",
            index=index,
        )
    width, height = image.size
    if width <= 0 or height <= 0:
        raise BadInput(f"image has no pixels ({width}x{height})", type="invalid_image", index=index)
    _check_pixels(width, height, index, max_pixels)
    return image


def probe_size(data: bytes, *, max_pixels: int, index: int | None = None) -> tuple[int, int]:
    """(width, height) from the header alone; the same checks as ``decode_image``."""
    return _open(data, index, max_pixels).size


def _pixel_bytes(mode: str) -> int:
    """Bytes per pixel as Pillow stores a decoded frame (RGB takes 4: it is stored as RGBX)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


def decoded_nbytes(data: bytes | Image.Image, *, max_pixels: int, index: int | None = None) -> int:
    """Memory that decoding and preprocessing ``data`` will hold at once, from the header alone:
    the decoded frame, its RGB conversion (unless it already is RGB), and the full-size uint8
    arrays an image processor makes of it before resizing (HWC, then CHW: measured, about 6 bytes
    a pixel). Raises as ``decode_image`` does for a bad header. ``data``: bytes or ``open_image``'s."""
    image = open_image(data, max_pixels=max_pixels, index=index)
    width, height = image.size
    pixels = width * height
    converted = 0 if image.mode == "RGB" else 4 * pixels
    return pixels * _pixel_bytes(image.mode) + converted + 6 * pixels


# EXIF orientations 5-8 rotate by 90 or 270 degrees: exif_transpose swaps width and height.
_EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = frozenset({5, 6, 7, 8})


@dataclass(frozen=True)
class Header:
    """What an image's header says, before any pixel is decoded."""

    width: int  # as stored, before the EXIF orientation
    height: int
    format: str  # Pillow's name: JPEG, MPO, PNG...
    mode: str  # Pillow's mode of the stored frame: RGB, L, CMYK...
    orientation: int  # EXIF orientation (1-8); 1 when there is none

    @property
    def oriented_size(self) -> tuple[int, int]:
        """(width, height) once the orientation is applied: swapped for orientations 5-8."""
        return (self.height, self.width) if self.orientation in _SWAPS_AXES else (self.width, self.height)


def read_header(data: bytes, *, max_pixels: int, index: int | None = None) -> Header:
    """The header of ``data``, with the same checks as ``decode_image`` (format, size)."""
    image = _open(data, index, max_pixels)
    width, height = image.size
    orientation = 1
    # Pillow's PNG getexif() decodes every pixel to look for an eXIf chunk after the image data;
    # a PNG whose bytes never spell the chunk type has none, so skip that cost exactly.
    if not (image.format == "PNG" and "exif" not in image.info and b"eXIf" not in data):
        try:
            value = image.getexif().get(_EXIF_ORIENTATION)
        except Exception:  # malformed EXIF or pixels: the encode fails or ignores it the same way
            value = None
        orientation = value if isinstance(value, int) and 1 <= value <= 8 else 1
    return Header(width, height, image.format or "", image.mode, orientation)


def oriented_size(data: bytes, *, max_pixels: int, index: int | None = None) -> tuple[int, int]:
    """(width, height) of the image the encoder will see, from the header alone.

    ``decode_image`` applies the EXIF orientation before the processor resizes, so a token count
    must use the oriented size: width and height swapped for orientations 5-8.
    """
    return read_header(data, max_pixels=max_pixels, index=index).oriented_size


def decode_image(data: bytes | Image.Image, *, max_pixels: int, index: int | None = None) -> Image.Image:
    """Decode the first frame, apply EXIF orientation, convert to RGB. ``data``: bytes, or what
    ``open_image`` made of them (decoded in place)."""
    image = open_image(data, max_pixels=max_pixels, index=index)
    try:
        image.seek(0)
        image.load()
        # In place, and no conversion of an RGB image: neither makes a full-size copy of the
        # frame (the request-memory budget charges the frame, not copies of it).
        ImageOps.exif_transpose(image, in_place=True)
        return image if image.mode == "RGB" else to_rgb(image)
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadInput(f"cannot decode image: {exc}", type="invalid_image", index=index) from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, as the encoders take it. Alpha is dropped (colour kept as stored), palettes expanded,
    CMYK/YCCK converted, 16-bit grayscale scaled to 8 bits (not clipped)."""
    if image.mode in _SIXTEEN_BIT:
        image = image.convert("I").point(lambda v: v * (1 / 257) + 0.5).convert("L")  # rounded
    return image.convert("RGB")
