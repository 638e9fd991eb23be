"""What decoding an image will hold, read from its header alone, and no full-size copies made."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from encode_server.core.errors import BadInput, TooLarge
from encode_server.imaging import decode_image, decoded_nbytes
from tests.images import bomb_png_header, image_bytes


def _png(mode: str, size: tuple[int, int] = (100, 50)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("mode", "per_pixel"),
    [("RGB", 4 + 6), ("RGBA", 4 + 4 + 6), ("L", 1 + 4 + 6), ("P", 1 + 4 + 6), ("I;16", 2 + 4 + 6)],
)
def test_decoded_bytes_are_the_frame_its_rgb_conversion_and_the_processor_arrays(mode: str, per_pixel: int) -> None:
    assert decoded_nbytes(_png(mode), max_pixels=10**6) == 100 * 50 * per_pixel


def test_the_estimate_comes_from_the_header_and_refuses_as_decoding_would() -> None:
    with pytest.raises(TooLarge):
        decoded_nbytes(bomb_png_header(), max_pixels=40_000_000)
    with pytest.raises(BadInput):
        decoded_nbytes(b"not an image", max_pixels=10**6)


def test_exif_orientation_is_still_applied_now_that_it_is_applied_in_place() -> None:
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: width and height swap
    Image.open(io.BytesIO(image_bytes("JPEG", 64, 48))).save(buf, format="JPEG", exif=exif)
    turned = decode_image(buf.getvalue(), max_pixels=10**6)
    assert turned.mode == "RGB" and turned.size == (48, 64)
    plain = decode_image(image_bytes("PNG", 64, 48), max_pixels=10**6)
    assert plain.mode == "RGB" and plain.size == (64, 48)
