"""What an image refused from its header is told: the server's own limit, and, for a video sent
as an image (or an image as a video), which modality its bytes are."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from encode_server.core.errors import BadInput, TooLarge
from encode_server.core.sniff import other_modality_hint, sniff
from encode_server.imaging import probe_size
from encode_server.video import probe
from tests.images import bomb_png_header, bomb_webp_header, image_bytes
from tests.videos import make_video


def test_a_header_above_pillows_own_limit_is_refused_with_the_servers_limit() -> None:
    # 900 M pixels: five times what Pillow itself refuses as a "decompression bomb".
    with pytest.raises(TooLarge) as refused:
        probe_size(bomb_png_header(30000, 30000), max_pixels=40_000_000, index=3)
    assert refused.value.message == (
        "image is 30000x30000 = 900000000 pixels, above the limit of 40000000 (--max-image-pixels)"
    )
    assert (refused.value.type, refused.value.index) == ("image_too_large", 3)


def _webp(size: tuple[int, int], **options: object) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format="WEBP", **options)
    return buf.getvalue()


@pytest.mark.parametrize(
    "options", [{"lossless": True}, {"lossless": False}, {"exif": Image.Exif().tobytes()}],
    ids=["VP8L", "VP8", "VP8X"],
)
def test_a_webp_above_the_limit_is_refused_from_its_header_before_libwebp_allocates_its_canvas(
    options: dict[str, object],
) -> None:
    # libwebp allocates the canvas when Pillow opens the file; with Pillow's limit off, only our
    # header read stands before it. Every one of WebP's three first chunks says its canvas.
    data = _webp((300, 200), **options)
    with pytest.raises(TooLarge) as refused:
        probe_size(data, max_pixels=59_999, index=1)
    assert refused.value.message == "image is 300x200 = 60000 pixels, above the limit of 59999 (--max-image-pixels)"
    assert probe_size(data, max_pixels=60_000) == (300, 200)


def test_a_webp_header_claiming_the_formats_maximum_is_too_large_not_unreadable() -> None:
    with pytest.raises(TooLarge) as refused:
        probe_size(bomb_webp_header(), max_pixels=40_000_000)
    assert refused.value.message == (
        "image is 16384x16384 = 268435456 pixels, above the limit of 40000000 (--max-image-pixels)"
    )


def test_a_max_image_pixels_above_pillows_own_limit_holds() -> None:
    assert probe_size(bomb_png_header(20000, 10000), max_pixels=300_000_000) == (20000, 10000)


def test_an_mp4_sent_as_an_image_is_told_it_is_a_video() -> None:
    with pytest.raises(BadInput) as refused:
        probe_size(make_video(4, 2.0, 32, 32, seed=5), max_pixels=40_000_000)
    assert refused.value.message == (
        'not a recognised image file; its bytes are mp4 video data: send it as a video ("modality": "video", '
        "or a video/* Content-Type)"
    )


def test_a_png_sent_as_a_video_is_told_it_is_an_image() -> None:
    with pytest.raises(BadInput) as refused:
        probe(image_bytes("PNG", 32, 32), index=0)
    assert refused.value.type == "invalid_video"
    assert refused.value.message.endswith(
        'its bytes are PNG image data: send it as an image ("modality": "image", or an image/* Content-Type)'
    )


@pytest.mark.parametrize(
    ("data", "found"),
    [
        (image_bytes("PNG"), ("image", "PNG")), (image_bytes("JPEG"), ("image", "JPEG")),
        (image_bytes("WEBP"), ("image", "WebP")), (image_bytes("GIF"), ("image", "GIF")),
        (image_bytes("TIFF"), ("image", "TIFF")), (image_bytes("BMP"), ("image", "BMP")),
        (make_video(4, 2.0, 32, 32), ("video", "mp4")),
        (make_video(4, 2.0, 32, 32, codec="libvpx-vp9"), ("video", "webm")),
        (make_video(4, 2.0, 32, 32, container_format="mpegts"), ("video", "MPEG-TS")),
        (b"\x00\x00\x00\x1cftypavif" + bytes(20), None),  # AVIF: a still image we do not take, no hint
        (bytes(range(256)), None),
    ],
)
def test_sniff_names_what_the_first_bytes_say(data: bytes, found: tuple[str, str] | None) -> None:
    assert sniff(data) == found


def test_no_hint_for_bytes_of_the_modality_they_were_sent_as() -> None:
    assert other_modality_hint(image_bytes("PNG"), "image") == ""
    assert other_modality_hint(make_video(4, 2.0, 32, 32), "video") == ""
    assert other_modality_hint(b"junk", "image") == ""
