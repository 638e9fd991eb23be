"""Mistral 3: a Pixtral tower at the image's aspect ratio, 2 x 2 merged and projected, equal to
``get_image_features``; N and the processed size from the size alone, as the processor resizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoImageProcessor

from bench.tower_ops import count
from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny import mistral3
from tests.tiny_models import load_full_model, reference_mistral3_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# multiples of 28; not; scaled down to the longest edge; extreme aspect ratios (one row is checked
# against vLLM only: transformers' own get_image_features fails on it)
SIZES = [(56, 56), (112, 84), (300, 200), (30, 400), (5000, 30), (30, 5000), (57, 61)]


def test_output_is_bit_identical_to_get_image_features(mistral3_dir: Path) -> None:
    encoder = load_encoder(str(mistral3_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        [encoded] = encoder.forward([encoder.preprocess(image)])
        assert torch.equal(decode(encoded), reference_mistral3_features(mistral3_dir, image)), (w, h)
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("mistral3", "projected", 64)


def test_a_batch_is_one_pass_giving_each_image_its_own_rows(mistral3_dir: Path) -> None:
    """Each image attends within itself in one attention call per layer per distinct length; its
    rows are its lone pass's but for the rounding of the longer matmuls."""
    encoder: Any = load_encoder(str(mistral3_dir), **CPU32)
    prepared = [encoder.preprocess(noise_image(w, h, seed=20 + i)) for i, (w, h) in enumerate(SIZES[:4])]
    batched, counts = count(lambda: encoder.forward(prepared))
    lengths = {(h // encoder.patch) * (w // encoder.patch) for h, w in (item.meta["image_sizes"] for item in prepared)}
    assert counts.attention_calls == len(encoder.module.vision_tower.transformer.layers) * len(lengths)
    assert counts.syncs == 0
    for item, encoded in zip(prepared, batched, strict=True):
        alone = decode(encoder.forward([item])[0])
        assert (decode(encoded) - alone).abs().max() <= 1e-5 * alone.abs().max()
        assert encoded.shape[0] == item.num_tokens


@pytest.mark.parametrize(("width", "height"), [*SIZES, (1, 1), (20, 20), (168, 168), (169, 10), (1920, 1080)])
def test_num_tokens_follow_the_processor(mistral3_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(mistral3_dir), **CPU32)
    image = noise_image(width, height)
    sizes = AutoImageProcessor.from_pretrained(mistral3_dir)(images=image, patch_size={"height": 28, "width": 28})
    h, w = (int(x) for x in sizes["image_sizes"][0])
    prepared = encoder.preprocess(image)
    assert prepared.num_tokens == (h // 28) * (w // 28)
    assert prepared.meta == {"image_sizes": [h, w]}
    assert prepared.cost_tokens == (h // 14) * (w // 14)
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)
    assert max(h, w) <= mistral3.LONGEST_EDGE


def test_the_fingerprint_covers_the_longest_edge(mistral3_dir: Path, tmp_path: Path) -> None:
    smaller = edited(mistral3_dir, tmp_path / "m", size={"longest_edge": 112})
    ours, theirs = load_encoder(str(mistral3_dir), **CPU32), load_encoder(str(smaller), **CPU32)
    assert theirs.count_tokens(300, 200)[0] < ours.count_tokens(300, 200)[0]
    assert model_fingerprint(theirs.info) != model_fingerprint(ours.info)


@pytest.mark.parametrize(("name", "value", "words"), [("patch_size", 16, "patch_size 16"),
                                                      ("spatial_merge_size", 1, "spatial_merge_size 1")])
def test_a_processor_that_disagrees_with_the_model_is_refused(
    mistral3_dir: Path, tmp_path: Path, name: str, value: int, words: str
) -> None:
    copy = shutil.copytree(mistral3_dir, tmp_path / "m")
    config = json.loads((copy / "processor_config.json").read_text())
    (copy / "processor_config.json").write_text(json.dumps({**config, name: value}))
    with pytest.raises(ValueError, match=words):
        load_encoder(str(copy), **CPU32)


def test_holds_no_language_model(mistral3_dir: Path) -> None:
    encoder: Any = load_encoder(str(mistral3_dir), **CPU32)
    full: Any = load_full_model(mistral3_dir)
    vision = num_parameters(full.model.vision_tower, full.model.multi_modal_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)
