"""GLM-4.1V: the Qwen-like tower's merged features equal ``get_image_features``; N and the grid from
GLM's own resize rule (its budget counted over the temporal patch), equal to the processor's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoImageProcessor

from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny_models import load_full_model, reference_qwen_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# inside the budget; resized; below the minimum; above the maximum; extreme aspect ratios
SIZES = [(56, 56), (112, 84), (10, 10), (300, 200), (640, 480), (5000, 30), (30, 400), (101, 99)]


def test_output_is_bit_identical_to_get_image_features(glm4v_dir: Path) -> None:
    encoder = load_encoder(str(glm4v_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        prepared = encoder.preprocess(image)
        [encoded] = encoder.forward([prepared])
        expected, grid = reference_qwen_features(glm4v_dir, image)
        assert torch.equal(decode(encoded), expected), (w, h)
        assert prepared.meta == {"image_grid_thw": grid}
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("glm4v", "merged", 64)


def test_a_batch_equals_each_image_alone(glm4v_dir: Path) -> None:
    encoder = load_encoder(str(glm4v_dir), **CPU32)
    images = [noise_image(w, h, seed=30 + i) for i, (w, h) in enumerate(SIZES[:4])]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    for image, encoded in zip(images, batched, strict=True):
        expected, _ = reference_qwen_features(glm4v_dir, image)
        torch.testing.assert_close(decode(encoded), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize(("width", "height"), [*SIZES, (1, 1), (28, 28), (1920, 1080), (333, 57)])
def test_count_tokens_is_the_processors_own_grid(glm4v_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(glm4v_dir), **CPU32)
    image = noise_image(width, height)
    grid = AutoImageProcessor.from_pretrained(glm4v_dir)(images=image)["image_grid_thw"][0].tolist()
    prepared = encoder.preprocess(image)
    assert prepared.meta == {"image_grid_thw": grid}
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)


def test_the_fingerprint_covers_the_pixel_budget(glm4v_dir: Path, tmp_path: Path) -> None:
    wider = edited(glm4v_dir, tmp_path / "m", size={"shortest_edge": 2 * 112 * 112, "longest_edge": 2 * 448 * 448})
    ours, theirs = load_encoder(str(glm4v_dir), **CPU32), load_encoder(str(wider), **CPU32)
    assert theirs.count_tokens(640, 480)[0] > ours.count_tokens(640, 480)[0]
    assert model_fingerprint(theirs.info) != model_fingerprint(ours.info)


def test_holds_only_the_vision_tower(glm4v_dir: Path) -> None:
    encoder: Any = load_encoder(str(glm4v_dir), **CPU32)
    full: Any = load_full_model(glm4v_dir)
    assert encoder.info.num_parameters == num_parameters(full.model.visual) < num_parameters(full)
