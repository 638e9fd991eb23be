"""LLaVA-NeXT and LLaVA-OneVision: tiles, unpadding, OneVision's anyres_max_9 downscale and the
newline rows, equal to ``get_image_features``; N from the size alone by the processor's count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from encode_server.encoders import load_encoder
from tests.tiny_models import load_full_model, reference_anyres_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: a family vLLM consumes follows vLLM's auto dtype (bfloat16 on this CPU), and these
# comparisons are with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# base + 1 tile; a 2x2 grid unpadded; 3x2; tall; past 9 tiles' worth (downscaled); a pixel; extremes
SIZES = [(56, 56), (112, 84), (300, 200), (30, 400), (1000, 900), (1, 1), (5000, 30), (30, 5000)]


@pytest.fixture(params=["llava_next", "llava_onevision"])
def anyres_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"{request.param}_dir"))


def test_output_is_bit_identical_to_get_image_features(anyres_dir: Path) -> None:
    encoder = load_encoder(str(anyres_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        prepared = encoder.preprocess(image)
        [encoded] = encoder.forward([prepared])
        assert torch.equal(decode(encoded), reference_anyres_features(anyres_dir, image)), (w, h)
        assert prepared.meta == {"image_sizes": [h, w]}
    assert (encoder.info.kind, encoder.info.hidden_size) == (anyres_dir.name.rstrip("0123456789"), 64)


def test_the_newline_rows_are_the_checkpoints_image_newline(anyres_dir: Path) -> None:
    """A 2x2-tile image's rows: 16 base rows, then each of the 8 grid rows followed by image_newline."""
    encoder: Any = load_encoder(str(anyres_dir), **CPU32)
    [encoded] = encoder.forward([encoder.preprocess(noise_image(112, 112))])
    rows, newline = decode(encoded), encoder.module.image_newline.detach()
    assert rows.shape[0] == 16 + 8 * (8 + 1)
    for r in range(8):
        assert torch.equal(rows[16 + r * 9 + 8], newline)


def test_a_batch_is_each_image_alone(anyres_dir: Path) -> None:
    encoder = load_encoder(str(anyres_dir), **CPU32)
    prepared = [encoder.preprocess(noise_image(w, h, seed=40 + i)) for i, (w, h) in enumerate(SIZES[:5])]
    for item, encoded in zip(prepared, encoder.forward(prepared), strict=True):
        alone = decode(encoder.forward([item])[0])
        torch.testing.assert_close(decode(encoded), alone, rtol=0, atol=1e-5 * float(alone.abs().max()))


@pytest.mark.parametrize(("width", "height"), [*SIZES, (640, 480), (224, 224), (225, 57), (1920, 1080)])
def test_count_tokens_equals_the_packed_rows(anyres_dir: Path, width: int, height: int) -> None:
    encoder = load_encoder(str(anyres_dir), **CPU32)
    prepared = encoder.preprocess(noise_image(width, height))
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)
    assert encoder.forward([prepared])[0].shape[0] == prepared.num_tokens


@pytest.mark.parametrize(
    ("change", "words"),
    [({"vision_aspect_ratio": "anyres_max_4"}, "anyres_max_9 only"), ({"vision_feature_layer": [-2, -1]}, "one layer")],
)
def test_what_vllm_would_compute_otherwise_is_refused(
    llava_onevision_dir: Path, tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    copy = shutil.copytree(llava_onevision_dir, tmp_path / "m")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=words):
        load_encoder(str(copy), **CPU32)


def test_holds_no_language_model(anyres_dir: Path) -> None:
    encoder: Any = load_encoder(str(anyres_dir), **CPU32)
    full: Any = load_full_model(anyres_dir)
    model = full.model
    vision = num_parameters(model.vision_tower, model.multi_modal_projector) + model.image_newline.numel()
    assert encoder.info.num_parameters == vision < num_parameters(full)


def test_a_cls_row_under_the_full_strategy_is_refused(llava_next_dir: Path, tmp_path: Path) -> None:
    """CLIP's CLS kept ("full") gives 17 rows a tile, which cannot be laid out as a 4x4 grid."""
    copy = shutil.copytree(llava_next_dir, tmp_path / "m")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "full"}))
    with pytest.raises(ValueError, match="17 rows a tile, not its 16 patches"):
        load_encoder(str(copy), **CPU32)
