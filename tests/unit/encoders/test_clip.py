"""CLIP / SigLIP: the adapter reproduces the full model's vision outputs and holds nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from encode_server.encoders import load_encoder
from tests.tiny_models import load_full_model, reference_clip_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

CASES = [("clip", "hidden"), ("clip", "pooled"), ("siglip", "hidden"), ("siglip", "pooled")]


@pytest.fixture
def dirs(clip_dir: Path, siglip_dir: Path) -> dict[str, Path]:
    return {"clip": clip_dir, "siglip": siglip_dir}


@pytest.mark.parametrize(("kind", "output"), CASES)
def test_output_is_bit_identical_to_the_full_model(
    dirs: dict[str, Path], image: Image.Image, kind: str, output: str
) -> None:
    encoder = load_encoder(str(dirs[kind]), device="cpu", output=output)
    [encoded] = encoder.forward([encoder.preprocess(image)])
    expected = reference_clip_features(dirs[kind], image, output)
    assert torch.equal(decode(encoded), expected.reshape(encoded.shape))
    assert encoded.shape == (encoder.count_tokens(*image.size)[0], encoder.info.hidden_size)
    assert (encoder.info.kind, encoder.info.output, encoder.info.dtype) == (kind, output, "float32")


@pytest.mark.parametrize(("kind", "output"), CASES)
def test_holds_only_the_vision_tower_and_projection(dirs: dict[str, Path], kind: str, output: str) -> None:
    encoder: Any = load_encoder(str(dirs[kind]), device="cpu", output=output)
    full: Any = load_full_model(dirs[kind])
    vision = [full.vision_model]
    if kind == "clip" and output == "pooled":
        vision.append(full.visual_projection)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == num_parameters(*vision)
    assert encoder.info.num_parameters < num_parameters(full)


def test_fixed_n_whatever_the_image_size(clip_dir: Path) -> None:
    encoder = load_encoder(str(clip_dir), device="cpu")
    sizes = [(100, 70), (20, 300), (640, 480)]
    prepared = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    assert {p.num_tokens for p in prepared} == {encoder.count_tokens(640, 480)[0]} == {17}  # 4x4 patches + CLS
    singles = [decode(encoder.forward([p])[0]) for p in prepared]
    batched = [decode(e) for e in encoder.forward(prepared)]
    for single, one_of_batch in zip(singles, batched, strict=True):
        torch.testing.assert_close(one_of_batch, single)


def test_vision_only_checkpoint_loads_the_same_weights(clip_dir: Path, tmp_path: Path, image: Image.Image) -> None:
    """transformers 5 saves a bare ``CLIPVisionModel`` without the ``vision_model.`` prefix."""
    full: Any = load_full_model(clip_dir)
    full.vision_model.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text((clip_dir / "preprocessor_config.json").read_text())
    from_full = load_encoder(str(clip_dir), device="cpu")
    vision_only = load_encoder(str(tmp_path), device="cpu")
    assert vision_only.info.weights_digest == from_full.info.weights_digest
    prepared = from_full.preprocess(image)
    assert vision_only.forward([prepared])[0] == from_full.forward([prepared])[0]


def test_clip_pooled_needs_the_projection(clip_dir: Path, tmp_path: Path) -> None:
    full: Any = load_full_model(clip_dir)
    full.vision_model.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text((clip_dir / "preprocessor_config.json").read_text())
    with pytest.raises(ValueError, match="visual_projection"):
        load_encoder(str(tmp_path), device="cpu", output="pooled")
