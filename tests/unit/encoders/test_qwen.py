"""Qwen2.5-VL: dynamic resolution, variable N, output equal to ``get_image_features``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from encode_server.encoders import load_encoder
from encode_server.encoders.qwen import PatchLinear
from tests.tiny_models import load_full_model, qwen_pixels, reference_qwen_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# (width, height): tiny, below min_pixels, wide, tall, above max_pixels, not multiples of 28
SIZES = [(28, 28), (10, 10), (300, 40), (45, 200), (640, 480), (101, 99)]


def test_output_is_bit_identical_to_get_image_features(qwen_dir: Path, image: Image.Image) -> None:
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    prepared = encoder.preprocess(image)
    [encoded] = encoder.forward([prepared])
    expected, grid = reference_qwen_features(qwen_dir, image)
    assert torch.equal(decode(encoded), expected)
    assert prepared.meta == {"image_grid_thw": grid}
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("qwen2_5_vl", "merged", 48)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_num_tokens_follow_the_models_own_processor(qwen_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(qwen_dir), device="cpu")
    image = noise_image(width, height)
    grid = AutoImageProcessor.from_pretrained(qwen_dir)(images=image, return_tensors="pt")["image_grid_thw"][0]
    prepared = encoder.preprocess(image)
    assert prepared.num_tokens == int(grid.prod()) // 2**2
    assert prepared.cost_tokens == int(grid.prod())
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)
    assert encoder.forward([prepared])[0].shape == (prepared.num_tokens, 48)


def test_batch_equals_the_models_own_batched_call(qwen_dir: Path) -> None:
    """Rows and grids are concatenated, then the output is split back by each image's N."""
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES[2:5])]
    prepared = [encoder.preprocess(image) for image in images]
    batched = encoder.forward(prepared)
    full: Any = load_full_model(qwen_dir)
    inputs = [qwen_pixels(qwen_dir, image) for image in images]
    with torch.inference_mode():
        expected = full.get_image_features(torch.cat([i["pixel_values"] for i in inputs]),
                                           torch.cat([i["image_grid_thw"] for i in inputs])).pooler_output
    assert [e.shape[0] for e in batched] == [p.num_tokens for p in prepared]
    for encoded, reference in zip(batched, expected, strict=True):
        assert torch.equal(decode(encoded), reference)


def test_qwen2_vl_output_is_bit_identical_too(qwen2_vl_dir: Path, image: Image.Image) -> None:
    encoder: Any = load_encoder(str(qwen2_vl_dir), device="cpu", dtype="float32")
    prepared = encoder.preprocess(image)
    [encoded] = encoder.forward([prepared])
    expected, grid = reference_qwen_features(qwen2_vl_dir, image)
    assert torch.equal(decode(encoded), expected)
    assert encoder.count_tokens(*image.size) == (prepared.num_tokens, {"image_grid_thw": grid})
    assert (encoder.info.kind, encoder.info.hidden_size) == ("qwen2_vl", 48)
    full: Any = load_full_model(qwen2_vl_dir)
    assert encoder.info.num_parameters == num_parameters(full.model.visual) < num_parameters(full)


def test_the_patch_matmul_is_the_convolution(qwen_dir: Path, image: Image.Image) -> None:
    """The server computes the stride-equals-kernel Conv3d as the matmul it is (as vLLM does): the
    same embedding as HF's convolution but for float rounding."""
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    [encoded] = encoder.forward([encoder.preprocess(image)])
    conv: Any = load_full_model(qwen_dir, conv_patch_embed=True)
    assert isinstance(conv.model.visual.patch_embed.proj, torch.nn.Conv3d)
    inputs = qwen_pixels(qwen_dir, image)
    with torch.inference_mode():
        expected = conv.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    got = decode(encoded)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_patch_linear_refuses_what_is_not_a_patch_projection() -> None:
    with pytest.raises(ValueError, match="not a patch projection"):
        PatchLinear(torch.nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(1, 14, 14)))


def test_holds_only_the_vision_transformer(qwen_dir: Path) -> None:
    encoder: Any = load_encoder(str(qwen_dir), device="cpu")
    full: Any = load_full_model(qwen_dir)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == num_parameters(full.model.visual)
    assert encoder.info.num_parameters < num_parameters(full)


def test_bfloat16_stays_bfloat16_on_the_wire(qwen_dir: Path, image: Image.Image) -> None:
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="bfloat16")
    [encoded] = encoder.forward([encoder.preprocess(image)])
    assert (encoder.info.dtype, encoded.dtype) == ("bfloat16", "bfloat16")
    assert encoded.nbytes == encoded.shape[0] * encoded.shape[1] * 2
    reference, _ = reference_qwen_features(qwen_dir, image)
    torch.testing.assert_close(decode(encoded).float(), reference, atol=0.1, rtol=0.1)


def test_preprocessing_names_the_torchvision_backend_it_follows(qwen_dir: Path) -> None:
    """This venv's processor is the PIL backend; the server makes the torchvision backend's pixels
    (vLLM's), and its fingerprint says so: the two resize otherwise and must not share a key."""
    encoder = load_encoder(str(qwen_dir), device="cpu")
    preprocessing = encoder.info.preprocessing
    assert type(AutoImageProcessor.from_pretrained(qwen_dir)).__name__ == "Qwen2VLImageProcessorPil"
    assert preprocessing["processor_class"] == "Qwen2VLImageProcessor"
    assert preprocessing["size"] == {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}


# (width, height) the tiny checkpoint's processor keeps as they are (multiples of 28, within its pixels)
UNRESIZED = [(56, 84), (112, 56), (224, 196)]


@pytest.mark.parametrize(("width", "height"), [*UNRESIZED, *SIZES, (1280, 720)])
def test_pixels_are_this_venvs_processors_but_for_its_resize(qwen_dir: Path, width: int, height: int) -> None:
    """The torch preprocessing against transformers' PIL backend (the torchvision one, vLLM's, is
    matched exactly in tests/vllm): the same grid and patch order, equal values where neither
    resizes (float rounding: the torch path fuses rescale and normalisation), and only the two
    bicubic kernels' rounding where both resize (measured on noise, the worst case: mean
    |diff| <= 5.6e-3, max 0.28, where one grey level is 0.015)."""
    encoder = load_encoder(str(qwen_dir), device="cpu")
    image = noise_image(width, height, seed=width)
    ours = encoder.preprocess(image).inputs
    theirs = AutoImageProcessor.from_pretrained(qwen_dir)(images=image, return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert ours["pixel_values"].shape == theirs["pixel_values"].shape
    diff = (ours["pixel_values"] - theirs["pixel_values"]).abs()
    if (width, height) in UNRESIZED:
        assert float(diff.max()) <= 1e-6
    else:
        assert float(diff.mean()) <= 1e-2 and float(diff.max()) <= 0.5
