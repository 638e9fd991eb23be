"""Llama 4: tiles plus a global tile, the vision model's pixel-shuffled rows through the projector,
output equal to ``get_image_features`` flattened as vLLM's ``mllama4.py`` hands it on, and vLLM's
tile count from the size alone.

The pixels themselves are checked against transformers' torchvision-only ``Llama4ImageProcessor``
in the vLLM venv (tests/vllm/test_llama4_pixels.py); here, the canvas rule and what follows it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from encode_server.encoders import load_encoder
from encode_server.encoders.llama4 import best_fit, tile_image
from encode_server.fingerprints import model_fingerprint
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny import llama4
from tests.tiny_models import load_full_model, reference_llama4_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: vLLM's auto dtype is bfloat16 on this CPU, and these compare with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# (width, height): one tile; 1x2 + global; 3x5 + global; tall 8x1 + global; one pixel; extreme ratios
SIZES = [(56, 56), (112, 56), (300, 200), (30, 400), (1, 1), (5000, 3), (3, 5000)]


def test_output_is_bit_identical_to_get_image_features(llama4_dir: Path) -> None:
    encoder = load_encoder(str(llama4_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        [encoded] = encoder.forward([encoder.preprocess(image)])
        assert torch.equal(decode(encoded), reference_llama4_features(llama4_dir, image)), (w, h)
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("llama4", "projected", 64)


def test_a_batch_is_each_images_tiles_in_order(llama4_dir: Path) -> None:
    encoder = load_encoder(str(llama4_dir), **CPU32)
    images = [noise_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES[:4])]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    for image, encoded in zip(images, batched, strict=True):
        # All the batch's tiles go through one matmul: on some CPUs (this suite's Intel Xeon, not its
        # AMD EPYC) the BLAS blocks a taller matrix otherwise and rounds a last bit apart.
        ours, alone = decode(encoded), reference_llama4_features(llama4_dir, image)
        assert ours.shape == alone.shape
        assert float((ours - alone).abs().max()) <= 1e-5 * max(1.0, float(alone.abs().max()))


@pytest.mark.parametrize(("width", "height"), [*SIZES, (640, 480), (168, 280), (57, 333), (1920, 1080)])
def test_count_tokens_is_the_tiles_the_image_is_cut_into(llama4_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(llama4_dir), **CPU32)
    prepared = encoder.preprocess(noise_image(width, height))
    tiles = prepared.inputs["pixel_values"].shape[0]
    rows, cols = prepared.meta["aspect_ratios"]
    assert tiles == (1 if rows * cols == 1 else rows * cols + 1) == prepared.meta["patches_per_image"]
    assert prepared.num_tokens == tiles * llama4.ROWS_PER_TILE
    assert prepared.cost_tokens == tiles * (16 + 1)
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)


def test_the_canvas_is_the_processors_best_fit() -> None:
    """The smallest upscale that fits (never past one tile's side), else the least downscale; ties
    to the smallest canvas; with resize_to_max_canvas, the largest upscale."""
    assert best_fit(56, 56, 16, 56, False) == (56, 56)
    assert best_fit(200, 300, 16, 56, False) == (168, 280)  # downscaled as little as possible
    assert best_fit(10, 20, 16, 56, False) == (56, 56)  # upscaled as little as possible (x2.8; 56 x 112: x5.6)
    assert best_fit(10, 20, 16, 56, True) == (168, 280)  # upscaled as much as 16 tiles allow (x14, 3 x 5 tiles)
    assert best_fit(5000, 3, 16, 56, False) == (896, 56)


def test_the_resize_follows_the_processors_float32_arithmetic(llama4_dir: Path) -> None:
    """200 x 300 into a 168 x 280 canvas: the processor's float32 scale (0.84) floors 300 x 0.84 to
    251 px, one column of padding more than the exact 252."""
    encoder: Any = load_encoder(str(llama4_dir), **CPU32)
    tiles, grid = tile_image(noise_image(300, 200), encoder.processor)
    assert grid == (3, 5)
    last_column = tiles[4, :, :, -6:]  # the top row's last tile: 280 - 251 = 29 px of padding; its last 6
    assert torch.equal(last_column, torch.full_like(last_column, -1.0))  # zero pixels, normalised
    assert tiles.dtype == torch.bfloat16


def test_the_fingerprint_covers_the_tiling(llama4_dir: Path, tmp_path: Path) -> None:
    fewer = edited(llama4_dir, tmp_path / "m", max_patches=4)
    ours, theirs = load_encoder(str(llama4_dir), **CPU32), load_encoder(str(fewer), **CPU32)
    assert theirs.count_tokens(2000, 200)[0] < ours.count_tokens(2000, 200)[0]
    assert model_fingerprint(theirs.info) != model_fingerprint(ours.info)


def test_a_processor_that_disagrees_with_the_tower_is_refused(llama4_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not match the tower"):
        load_encoder(str(edited(llama4_dir, tmp_path / "a", size={"height": 28, "width": 28})), **CPU32)
    with pytest.raises(ValueError, match="bilinear"):
        load_encoder(str(edited(llama4_dir, tmp_path / "b", resample=3)), **CPU32)


def test_the_nested_processor_config_alone_is_read(llama4_dir: Path, tmp_path: Path) -> None:
    """transformers 5.19 writes the image processor's settings only into processor_config.json."""
    copy = shutil.copytree(llama4_dir, tmp_path / "c")
    (copy / "preprocessor_config.json").unlink()
    nested = json.loads((copy / "processor_config.json").read_text())
    nested["image_processor"]["max_patches"] = 4
    (copy / "processor_config.json").write_text(json.dumps(nested))
    assert load_encoder(str(copy), **CPU32).count_tokens(2000, 200) == (5 * 4, {"aspect_ratios": [1, 4],
                                                                                 "patches_per_image": 5})


def test_holds_no_language_model(llama4_dir: Path) -> None:
    encoder: Any = load_encoder(str(llama4_dir), **CPU32)
    full: Any = load_full_model(llama4_dir)
    vision = num_parameters(full.vision_model, full.multi_modal_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)


def test_pooled_output_is_refused(llama4_dir: Path) -> None:
    with pytest.raises(ValueError, match="projected"):
        load_encoder(str(llama4_dir), **CPU32, output="pooled")
