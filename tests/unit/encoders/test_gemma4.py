"""Gemma 4 images: the tower's pooled, embedded rows equal ``get_image_features`` bit for bit, a
row count from the size alone that is vLLM's placeholder count and the processor's rows, and a
checkpoint vLLM would size otherwise than its tower is refused."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from encode_server.core.errors import BadInput
from encode_server.core.settings import resolve
from encode_server.encoders import gemma4 as gemma4_module
from encode_server.encoders import load_encoder
from tests.tiny import copy_with_processor_settings as edited
from tests.tiny import gemma4
from tests.tiny_models import load_full_model, reference_gemma4_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# the largest size of its aspect ratio within the budget (not resized); scaled up, down; a single
# pixel; extreme aspect ratios (one pooled row or column, capped at the budget); odd sides
SIZES = [(240, 144), (112, 56), (300, 200), (30, 400), (1, 1), (5000, 3), (3, 5000), (61, 47)]


def test_output_is_bit_identical_to_get_image_features(gemma4_dir: Path) -> None:
    encoder = load_encoder(str(gemma4_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        prepared = encoder.preprocess(image)
        [encoded] = encoder.forward([prepared])
        [reference] = reference_gemma4_features(gemma4_dir, [image])
        assert torch.equal(decode(encoded), reference), (w, h)
        assert prepared.num_tokens == reference.shape[0] <= gemma4.MAX_SOFT_TOKENS
        assert encoder.count_tokens(w, h) == (prepared.num_tokens, {}), (w, h)
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("gemma4", "projected", 64)


def test_a_batch_equals_the_models_own_batched_call(gemma4_dir: Path) -> None:
    """Images of several row counts in one pass (all padded to the same patches), split back by count."""
    encoder = load_encoder(str(gemma4_dir), **CPU32)
    images = [noise_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES[:5])]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    references = reference_gemma4_features(gemma4_dir, images)
    assert len({r.shape[0] for r in references}) > 2
    for encoded, reference in zip(batched, references, strict=True):
        assert torch.equal(decode(encoded), reference)


def test_count_tokens_is_the_processors_row_count_for_any_size(gemma4_dir: Path) -> None:
    """vLLM's placeholder rule (``soft_tokens``) against the image processor's own resize rule, the
    rows its tower then makes, over random sizes, thin strips among them, at every budget the
    processor takes and the hub's 16 px patches."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    rng = random.Random(0)
    sizes = [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(3000)]
    sizes += [(rng.randint(1, 4000), rng.randint(1, 40)) for _ in range(1000)]
    sizes += [(h, w) for w, h in sizes[-1000:]]
    for patch, k, budget in [(8, 3, 70), (16, 3, 70), (16, 3, 280), (16, 3, 1120), (14, 2, 140)]:
        for w, h in sizes:
            th, tw = get_aspect_ratio_preserving_size(h, w, patch, budget * k * k, k)
            rows = (th // patch) * (tw // patch) // k**2
            counted = gemma4_module.soft_tokens(w, h, patch_size=patch, pooling_kernel_size=k, max_soft_tokens=budget)
            assert counted == rows, ((w, h), (patch, k, budget), counted, rows)


def test_holds_no_language_model(gemma4_dir: Path) -> None:
    encoder: Any = load_encoder(str(gemma4_dir), **CPU32)
    full: Any = load_full_model(gemma4_dir)
    vision = num_parameters(full.model.vision_tower, full.model.embed_vision)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)


def test_standardisation_and_clip_bounds_are_loaded(gemma4_dir: Path) -> None:
    """The tower's buffers come from the checkpoint (the tiny one draws them), not transformers' identity."""
    encoder: Any = load_encoder(str(gemma4_dir), **CPU32)
    full: Any = load_full_model(gemma4_dir)
    ours, theirs = encoder.module.vision_tower, full.model.vision_tower
    assert torch.equal(ours.std_scale, theirs.std_scale)
    assert not torch.equal(ours.std_scale, torch.ones_like(ours.std_scale))
    assert float(ours.encoder.layers[0].mlp.up_proj.input_max) == 4.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_soft_tokens": 140}, "max_soft_tokens 140 != the model's 70"),
        ({"patch_size": 16}, "patch_size 16 != the model's 8"),
        ({"pooling_kernel_size": 2}, "pooling_kernel_size 2 != the model's 3"),
        ({"do_resize": False}, "must resize"),
    ],
)
def test_a_processor_vllm_would_size_otherwise_is_refused(
    gemma4_dir: Path, tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_encoder(str(edited(gemma4_dir, tmp_path / "m", **settings)), **CPU32)


def test_a_vision_config_without_vllms_budget_is_refused(gemma4_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(gemma4_dir, tmp_path / "m")
    config = json.loads((copy / "config.json").read_text())
    del config["vision_config"]["default_output_length"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="default_output_length"):
        load_encoder(str(copy), **CPU32)


def test_pooled_output_is_refused(gemma4_dir: Path) -> None:
    with pytest.raises(ValueError, match="projected"):
        load_encoder(str(gemma4_dir), **CPU32, output="pooled")


def test_vllms_per_request_budget_is_refused_not_ignored(gemma4_dir: Path) -> None:
    """vLLM takes ``max_soft_tokens`` per request; this family declares no settings, so a request
    naming it is refused, never encoded at the default budget under another placeholder count."""
    encoder = load_encoder(str(gemma4_dir), **CPU32)
    assert encoder.family is not None and encoder.family.settings == ()
    with pytest.raises(BadInput, match="max_soft_tokens"):
        resolve(encoder.family.settings, encoder.setting_defaults(), {"max_soft_tokens": 140}, {})

