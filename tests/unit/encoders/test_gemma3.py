"""Gemma 3: SigLIP pooled to ``mm_tokens_per_image`` rows, equal to ``get_image_features``; pan-and-scan
off as ``Gemma3Processor`` calls it; a processor or a layout vLLM could not serve is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor

from encode_server.core.errors import BadInput
from encode_server.core.settings import resolve
from encode_server.encoders import gemma3 as gemma3_module
from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny import gemma3
from tests.tiny_models import load_full_model, reference_gemma3_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# at the tower's size; resized down, up; a single pixel; extreme aspect ratios
SIZES = [(64, 64), (112, 56), (300, 200), (30, 400), (1, 1), (5000, 3), (3, 5000)]


def test_output_is_bit_identical_to_get_image_features(gemma3_dir: Path) -> None:
    encoder = load_encoder(str(gemma3_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        prepared = encoder.preprocess(image)
        [encoded] = encoder.forward([prepared])
        [reference] = reference_gemma3_features(gemma3_dir, [image])
        assert torch.equal(decode(encoded), reference), (w, h)
        assert prepared.num_tokens == gemma3.MM_TOKENS and encoder.count_tokens(w, h) == (gemma3.MM_TOKENS, {})
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("gemma3", "projected", 64)


def test_a_batch_equals_the_models_own_batched_call(gemma3_dir: Path) -> None:
    encoder = load_encoder(str(gemma3_dir), **CPU32)
    images = [noise_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES[:4])]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    for encoded, reference in zip(batched, reference_gemma3_features(gemma3_dir, images), strict=True):
        assert torch.equal(decode(encoded), reference)


def test_pan_and_scan_saved_on_is_not_applied(gemma3_dir: Path, tmp_path: Path) -> None:
    """Gemma3Processor passes do_pan_and_scan=False at call time over the saved attribute, and vLLM
    sizes its placeholder from the same merged default: one crop, the same rows and fingerprint."""
    saved_on = edited(gemma3_dir, tmp_path / "m", do_pan_and_scan=True, pan_and_scan_min_crop_size=8)
    ours, theirs = load_encoder(str(gemma3_dir), **CPU32), load_encoder(str(saved_on), **CPU32)
    wide = noise_image(640, 64)
    prepared = theirs.preprocess(wide)
    assert prepared.inputs["pixel_values"].shape[0] == 1, "pan-and-scan crops were cut"
    assert prepared.num_tokens == ours.preprocess(wide).num_tokens == gemma3.MM_TOKENS
    assert model_fingerprint(theirs.info) == model_fingerprint(ours.info)


def test_a_processor_that_disagrees_with_the_tower_is_refused(gemma3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the tower takes 64 px"):
        load_encoder(str(edited(gemma3_dir, tmp_path / "a", size={"height": 32, "width": 32})), **CPU32)
    copy = shutil.copytree(gemma3_dir, tmp_path / "b")
    config = json.loads((copy / "processor_config.json").read_text())
    (copy / "processor_config.json").write_text(json.dumps({**config, "image_seq_length": 256}))
    with pytest.raises(ValueError, match="image_seq_length 256 != mm_tokens_per_image 16"):
        load_encoder(str(copy), **CPU32)


def test_siglip_without_its_vision_model_level_is_refused(gemma3_dir: Path, tmp_path: Path) -> None:
    """The layout transformers 5's save_pretrained writes (no ``vision_model.``), which vLLM's loader
    cannot read either: a clear error naming the tensors, not a half-loaded tower."""
    copy = shutil.copytree(gemma3_dir, tmp_path / "m")
    state = load_file(copy / "model.safetensors")
    save_file({k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in state.items()},
              copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match Gemma3Vision"):
        load_encoder(str(copy), **CPU32)


def test_holds_no_language_model(gemma3_dir: Path) -> None:
    encoder: Any = load_encoder(str(gemma3_dir), **CPU32)
    full: Any = load_full_model(gemma3_dir)
    vision = num_parameters(full.model.vision_tower, full.model.multi_modal_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)


def test_pooled_output_is_refused(gemma3_dir: Path) -> None:
    with pytest.raises(ValueError, match="projected"):
        load_encoder(str(gemma3_dir), **CPU32, output="pooled")


# Pan-and-scan per request (vLLM's mm_processor_kwargs): crop sides down to 32 px on the tiny tower.
PAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
# wide, tall, square (never cut), under the ratio, very wide (capped at 4 crops), crops under 32 px
PAN_SIZES = [(300, 100), (100, 300), (64, 64), (70, 64), (1000, 40), (60, 20), (130, 64), (5000, 3)]


@pytest.mark.parametrize(("width", "height"), PAN_SIZES)
def test_pan_and_scan_rows_are_the_whole_image_then_each_crop(gemma3_dir: Path, width: int, height: int) -> None:
    """The processor's crops (its own ``pan_and_scan``), each through the full model's
    ``get_image_features``, flattened in order: what vLLM hands its language model for the item;
    ``count_tokens_with`` counts them from the size alone."""
    encoder = load_encoder(str(gemma3_dir), **CPU32)
    settings = {**encoder.setting_defaults(), **PAN}
    image = noise_image(width, height, seed=width)
    prepared = encoder.preprocess_with(image, settings)
    [encoded] = encoder.forward([prepared])
    processor = AutoImageProcessor.from_pretrained(gemma3_dir)
    inputs = processor(images=image, return_tensors="pt", **settings)
    crops = int(inputs["num_crops"][0])
    full: Any = load_full_model(gemma3_dir)
    with torch.inference_mode():
        expected = full.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)
    assert torch.equal(decode(encoded), expected)
    assert prepared.num_tokens == (1 + crops) * gemma3.MM_TOKENS == expected.shape[0]
    assert encoder.count_tokens_with(width, height, settings) == (prepared.num_tokens, {})
    assert prepared.cost_tokens == encoder.cost_of(prepared.num_tokens, {})


def test_a_batch_of_cut_and_whole_images_splits_back_by_each_items_crops(gemma3_dir: Path) -> None:
    encoder = load_encoder(str(gemma3_dir), **CPU32)
    settings = {**encoder.setting_defaults(), **PAN}
    images = [noise_image(w, h, seed=40 + i) for i, (w, h) in enumerate([(300, 100), (64, 64), (100, 300)])]
    prepared = [encoder.preprocess_with(images[0], settings), encoder.preprocess(images[1]),
                encoder.preprocess_with(images[2], settings)]
    batched = encoder.forward(prepared)
    alone = [encoder.forward([item])[0] for item in prepared]
    assert [decode(e).shape[0] for e in batched] == [p.num_tokens for p in prepared] == [64, 16, 64]
    for got, want in zip(batched, alone, strict=True):
        torch.testing.assert_close(decode(got), decode(want), rtol=0, atol=1e-5)


def test_more_crops_than_the_checkpoint_allows_are_refused_naming_the_key(gemma3_dir: Path) -> None:
    encoder = load_encoder(str(gemma3_dir), **CPU32)
    defaults = encoder.setting_defaults()
    assert resolve(gemma3_module.SETTINGS, defaults, {"pan_and_scan_max_num_crops": 4}, {}) is None
    with pytest.raises(BadInput, match="pan_and_scan_max_num_crops must be at least 1 and at most 4"):
        resolve(gemma3_module.SETTINGS, defaults, {"pan_and_scan_max_num_crops": 5}, {})
    with pytest.raises(BadInput, match="do_pan_and_scan must be true or false"):
        resolve(gemma3_module.SETTINGS, defaults, {"do_pan_and_scan": 1}, {})
