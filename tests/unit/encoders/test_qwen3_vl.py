"""Qwen3-VL (dense, MoE) and Qwen3.5: the tower's merged rows with DeepStack's packed after them,
Qwen2-VL's token rule at patch 16, both processor-config layouts, the video settings fingerprinted."""

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
from tests.tiny_models import load_full_model, make_qwen3, reference_qwen3_features
from tests.unit.encoders.util import decode, noise_image, num_parameters
from tests.vllm.tiny_qwen3 import DEEPSTACK

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

KINDS = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
# (width, height): below min_pixels, unresized, wide, tall, above max_pixels, odd
SIZES = [(20, 20), (64, 96), (400, 40), (45, 300), (640, 480), (101, 99)]
OUT_HIDDEN = 64


@pytest.fixture(scope="module", params=KINDS)
def qwen3_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("qwen3_vl_dense"))


def _width(kind: str) -> int:
    return OUT_HIDDEN * (1 + len(DEEPSTACK)) if kind.startswith("qwen3_vl") else OUT_HIDDEN


def test_output_is_merged_then_deepstack_bit_identical(qwen3_dir: Path) -> None:
    """Row for row and column for column what vLLM's embed_multimodal packs: the merger's rows, then
    each DeepStack merger's, on the last dimension (Qwen3.5: the merger's alone)."""
    encoder = load_encoder(str(qwen3_dir), **CPU32)
    kind = json.loads((qwen3_dir / "config.json").read_text())["model_type"]
    image = noise_image(100, 70)
    prepared = encoder.preprocess(image)
    [encoded] = encoder.forward([prepared])
    expected, grid = reference_qwen3_features(qwen3_dir, image)
    assert encoded.shape == (prepared.num_tokens, _width(kind)) == tuple(expected.shape)
    assert torch.equal(decode(encoded), expected)
    assert prepared.meta == {"image_grid_thw": grid}
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == (kind, "merged", _width(kind))


def test_deepstack_columns_are_not_the_merged_ones(dense_dir: Path) -> None:
    """The wide rows are three distinct blocks: dropping or repeating DeepStack would show here."""
    encoder = load_encoder(str(dense_dir), **CPU32)
    [encoded] = encoder.forward([encoder.preprocess(noise_image(64, 96))])
    blocks = decode(encoded).split(OUT_HIDDEN, dim=-1)
    assert len(blocks) == 1 + len(DEEPSTACK)
    assert not torch.equal(blocks[0], blocks[1]) and not torch.equal(blocks[1], blocks[2])


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_num_tokens_follow_the_models_own_processor(dense_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(dense_dir), **CPU32)
    image = noise_image(width, height)
    grid = AutoImageProcessor.from_pretrained(dense_dir)(images=image, return_tensors="pt")["image_grid_thw"][0]
    prepared = encoder.preprocess(image)
    assert prepared.num_tokens == int(grid.prod()) // 2**2
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)


def test_batch_equals_one_by_one(dense_dir: Path) -> None:
    """Images batched (patches concatenated, split back by N) give each image's own rows."""
    encoder = load_encoder(str(dense_dir), **CPU32)
    prepared = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES[1:5])]
    batched = encoder.forward(prepared)
    for one, item in zip(batched, prepared, strict=True):
        [alone] = encoder.forward([item])
        torch.testing.assert_close(decode(one), decode(alone), atol=1e-5, rtol=1e-5)


def test_holds_only_the_vision_tower(qwen3_dir: Path) -> None:
    encoder: Any = load_encoder(str(qwen3_dir), **CPU32)
    full: Any = load_full_model(qwen3_dir)
    assert encoder.info.num_parameters == num_parameters(full.model.visual) < num_parameters(full)


def test_both_processor_layouts_load_alike(dense_dir: Path, tmp_path: Path) -> None:
    """transformers 5's nested processor_config.json and the hub's two files: one encoder, one fingerprint."""
    from tests.vllm.tiny_qwen3 import _to_hub_layout

    hub = tmp_path / "hub"
    shutil.copytree(dense_dir, hub)
    _to_hub_layout(hub)
    assert (hub / "video_preprocessor_config.json").is_file() and (hub / "preprocessor_config.json").is_file()
    nested, split = load_encoder(str(dense_dir), **CPU32), load_encoder(str(hub), **CPU32)
    assert split.info.preprocessing == nested.info.preprocessing
    assert split.info.preprocessing["video_processor"]["fps"] == 2.0
    assert model_fingerprint(split.info) == model_fingerprint(nested.info)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("image_processor", "size", {"shortest_edge": 4096, "longest_edge": 128 * 128}),
     ("video_processor", "fps", 1.0), ("video_processor", "max_frames", 32),
     ("video_processor", "size", {"shortest_edge": 4096, "longest_edge": 65536})],
)
def test_every_processor_setting_that_changes_tokens_changes_the_fingerprint(
    dense_dir: Path, tmp_path: Path, section: str, key: str, value: Any
) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(dense_dir, edited)
    config = json.loads((edited / "processor_config.json").read_text())
    config[section][key] = value
    (edited / "processor_config.json").write_text(json.dumps(config))
    before = model_fingerprint(load_encoder(str(dense_dir), **CPU32).info)
    assert model_fingerprint(load_encoder(str(edited), **CPU32).info) != before
