"""InternVL (HF format): tiles, pixel shuffle and projector, output equal to ``get_image_features``
as vLLM's ``interns1.py`` computes it, and the tile count of ``InternVLProcessor``'s call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoImageProcessor

from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny import internvl
from tests.tiny_models import load_full_model, reference_internvl_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# (width, height): one tile; 2x1 tiles + thumbnail; 3x2 + thumbnail; tall; a single pixel; extreme ratios
SIZES = [(56, 56), (112, 56), (300, 200), (30, 400), (1, 1), (5000, 3), (3, 5000)]


def test_output_is_bit_identical_to_get_image_features(internvl_dir: Path) -> None:
    encoder = load_encoder(str(internvl_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        [encoded] = encoder.forward([encoder.preprocess(image)])
        [reference] = reference_internvl_features(internvl_dir, [image])
        assert torch.equal(decode(encoded), reference), (w, h)
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("internvl", "projected", 64)


def test_a_batch_is_each_images_tiles_in_order(internvl_dir: Path) -> None:
    """Tiles of all images in one forward pass, split back per image: what the model's own batched
    call gives, image by image."""
    encoder = load_encoder(str(internvl_dir), **CPU32)
    images = [noise_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES[:4])]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    for encoded, reference in zip(batched, reference_internvl_features(internvl_dir, images), strict=True):
        assert torch.equal(decode(encoded), reference)


@pytest.mark.parametrize(("width", "height"), [*SIZES, (640, 480), (448, 448), (57, 333), (1920, 1080)])
def test_num_tokens_are_the_processors_tiles(internvl_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(internvl_dir), **CPU32)
    image = noise_image(width, height)
    tiles = int(AutoImageProcessor.from_pretrained(internvl_dir)(images=image, crop_to_patches=True)["num_patches"][0])
    prepared = encoder.preprocess(image)
    assert prepared.num_tokens == tiles * internvl.ROWS_PER_TILE
    assert prepared.meta == {"image_num_patches": tiles}
    assert prepared.cost_tokens == tiles * (16 + 1)
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)


def test_tiles_whatever_the_saved_crop_to_patches_says(internvl_dir: Path, tmp_path: Path) -> None:
    """InternVLProcessor passes crop_to_patches=True at call time over the saved attribute, so a
    checkpoint saved with False is tiled all the same: same counts, same fingerprint."""
    saved_false = edited(internvl_dir, tmp_path / "m", crop_to_patches=False)
    assert AutoImageProcessor.from_pretrained(saved_false).crop_to_patches is False
    ours, theirs = load_encoder(str(internvl_dir), **CPU32), load_encoder(str(saved_false), **CPU32)
    assert theirs.count_tokens(300, 200) == ours.count_tokens(300, 200) == (28, {"image_num_patches": 7})
    assert model_fingerprint(theirs.info) == model_fingerprint(ours.info)


def test_the_fingerprint_covers_the_tiling(internvl_dir: Path, tmp_path: Path) -> None:
    more = edited(internvl_dir, tmp_path / "m", max_patches=12)
    ours, theirs = load_encoder(str(internvl_dir), **CPU32), load_encoder(str(more), **CPU32)
    assert theirs.count_tokens(2000, 200)[0] > ours.count_tokens(2000, 200)[0]
    assert model_fingerprint(theirs.info) != model_fingerprint(ours.info)


def test_a_processor_that_disagrees_with_the_tower_is_refused(internvl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not match the tower"):
        load_encoder(str(edited(internvl_dir, tmp_path / "a", size={"height": 28, "width": 28})), **CPU32)
    copy = shutil.copytree(internvl_dir, tmp_path / "b")
    config = json.loads((copy / "processor_config.json").read_text())
    (copy / "processor_config.json").write_text(json.dumps({**config, "image_seq_length": 256}))
    with pytest.raises(ValueError, match="image_seq_length 256"):
        load_encoder(str(copy), **CPU32)


def test_holds_no_language_model(internvl_dir: Path) -> None:
    encoder: Any = load_encoder(str(internvl_dir), **CPU32)
    full: Any = load_full_model(internvl_dir)
    vision = num_parameters(full.model.vision_tower, full.model.multi_modal_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)


def test_pooled_output_is_refused(internvl_dir: Path) -> None:
    with pytest.raises(ValueError, match="projected"):
        load_encoder(str(internvl_dir), **CPU32, output="pooled")
