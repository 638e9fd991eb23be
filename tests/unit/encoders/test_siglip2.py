"""SigLIP2 NaFlex: aspect-preserving patch grids, padding dropped from the hidden output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoImageProcessor

from encode_server.encoders import load_encoder
from tests.tiny_models import load_full_model, reference_clip_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

SIZES = [(100, 70), (300, 40), (16, 16), (45, 200)]


@pytest.mark.parametrize("output", ["hidden", "pooled"])
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_output_is_bit_identical_to_the_full_model(siglip2_dir: Path, output: str, width: int, height: int) -> None:
    encoder = load_encoder(str(siglip2_dir), device="cpu", output=output)
    image = noise_image(width, height)
    prepared = encoder.preprocess(image)
    [encoded] = encoder.forward([prepared])
    assert torch.equal(decode(encoded), reference_clip_features(siglip2_dir, image, output).reshape(encoded.shape))
    assert (
        encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta) == (encoded.shape[0], prepared.meta)
    )
    assert prepared.cost_tokens == 24


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_hidden_tokens_are_the_images_own_patches(siglip2_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(siglip2_dir), device="cpu")
    processed = AutoImageProcessor.from_pretrained(siglip2_dir)(images=noise_image(width, height), return_tensors="pt")
    prepared = encoder.preprocess(noise_image(width, height))
    assert prepared.num_tokens == int(processed["pixel_attention_mask"].sum()) <= 24
    assert prepared.meta == {"spatial_shapes": processed["spatial_shapes"][0].tolist()}


def test_batch_splits_back_per_image(siglip2_dir: Path) -> None:
    encoder = load_encoder(str(siglip2_dir), device="cpu")
    prepared = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    for item, encoded in zip(prepared, encoder.forward(prepared), strict=True):
        torch.testing.assert_close(decode(encoded), decode(encoder.forward([item])[0]))


def test_holds_only_the_vision_tower(siglip2_dir: Path) -> None:
    encoder: Any = load_encoder(str(siglip2_dir), device="cpu")
    full: Any = load_full_model(siglip2_dir)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == num_parameters(full.vision_model)
    assert encoder.info.num_parameters < num_parameters(full)
