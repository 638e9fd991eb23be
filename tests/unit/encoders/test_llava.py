"""LLaVA: tower + projector only, output equal to ``get_image_features``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from encode_server.encoders import load_encoder
from tests.tiny_models import load_full_model, reference_llava_features
from tests.unit.encoders.util import decode, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}


def test_output_is_bit_identical_to_get_image_features(llava_dir: Path, image: Image.Image) -> None:
    encoder = load_encoder(str(llava_dir), **CPU32)
    [encoded] = encoder.forward([encoder.preprocess(image)])
    expected = reference_llava_features(llava_dir, image)
    assert torch.equal(decode(encoded), expected)
    # 4x4 patches, CLS dropped ("default" strategy), in the language model's hidden size
    assert encoded.shape == (16, 48) == (encoder.count_tokens(*image.size)[0], encoder.info.hidden_size)
    assert (encoder.info.kind, encoder.info.output) == ("llava", "projected")


def test_holds_no_language_model(llava_dir: Path) -> None:
    encoder: Any = load_encoder(str(llava_dir), **CPU32)
    full: Any = load_full_model(llava_dir)
    vision = num_parameters(full.model.vision_tower, full.model.multi_modal_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision
    assert encoder.info.num_parameters < num_parameters(full)


def test_pooled_output_is_refused(llava_dir: Path) -> None:
    with pytest.raises(ValueError, match="projected"):
        load_encoder(str(llava_dir), **CPU32, output="pooled")


def test_a_variable_resolution_tower_is_refused_clearly(llava_dir: Path, tmp_path: Path) -> None:
    """Pixtral-12B's HF format is a ``llava`` model with a Pixtral tower: N varies with the image, which
    this fixed-N family cannot count; a clear error at start, not an AttributeError."""
    import json
    import shutil

    copy = shutil.copytree(llava_dir, tmp_path / "m")
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"]["model_type"] = "pixtral"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pixtral tower"):
        load_encoder(str(copy), **CPU32)
