"""The parts of the batched preprocessing path that need no torchvision (the rest: tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from encode_server.encoders import load_encoder
from encode_server.encoders.batched import orient
from encode_server.encoders.hf import HFEncoder


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
