"""The parts of the batched preprocessing path that need no torchvision (the rest: tests/gpu)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from bench.workload import photos
from encode_server.encoders import load_encoder
from encode_server.encoders.batched import _tables_defined, orient
from encode_server.encoders.hf import HFEncoder
from tests.images import jpeg_without_tables


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_turns_an_image_as_exif_transpose_does(orientation: int) -> None:
    pixels = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    exif = image.getexif()
    exif[0x0112] = orientation
    image.info["exif"] = exif.tobytes()
    expected = np.asarray(ImageOps.exif_transpose(image)).transpose(2, 0, 1)
    ours = orient(torch.from_numpy(pixels.transpose(2, 0, 1).copy()), orientation)
    assert np.array_equal(ours.numpy(), expected)


def test_preprocessing_on_the_model_device_without_torchvision_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs torchvision"):
        load_encoder("builtin:tiny", device="cpu", preprocess_device="model")


def test_auto_keeps_the_cpu_path_on_a_cpu_model_and_unknown_values_are_refused() -> None:
    encoder = load_encoder("builtin:tiny", device="cpu", preprocess_device="auto")
    assert isinstance(encoder, HFEncoder) and encoder.batched is None and not encoder.preprocesses_on_device
    assert "pipeline" not in encoder.info.preprocessing
    with pytest.raises(ValueError, match="preprocess_device"):
        load_encoder("builtin:tiny", device="cpu", preprocess_device="gpu")


def _jpeg(mode: str = "RGB", **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (40, 30), 90).save(buffer, format="JPEG", **save)
    return buffer.getvalue()


def _name_table(data: bytes, table: int) -> bytes:
    """``data`` with every component of its frame naming quantization table ``table``."""
    out = bytearray(data)
    start = out.index(b"\xff\xc0") + 4  # baseline SOF0's segment, after its length
    for k in range(out[start + 5]):
        out[start + 8 + 3 * k] = table
    return bytes(out)


def test_a_jpeg_goes_to_the_device_decoder_only_when_it_defines_every_table_it_uses() -> None:
    """nvJPEG decodes a stream using an undefined quantization table into grey, where libjpeg (and
    so the CPU path) refuses it: such a stream must wait for Pillow instead."""
    for good in (_jpeg(), _jpeg("L"), _jpeg(progressive=True), _jpeg(subsampling=0), *photos(7, 2)):
        assert _tables_defined(good)
    gray = _jpeg("L")  # defines table 0 only
    assert not _tables_defined(_name_table(gray, 1))
    assert not _tables_defined(jpeg_without_tables())
    assert not _tables_defined(b"\xff\xd8\xff\xd9") and not _tables_defined(b"\xff\xd8")
