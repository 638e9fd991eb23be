"""Kimi-K2.5: the NaViT resize and padding, MoonViT under the hub's weight names, rows equal to
transformers' ``get_image_features`` (its own conversion of the same weights), and vLLM's
placeholder count from the size alone.

The patches themselves are checked against vLLM's numba processor, and the rows against vLLM's
tower, in the vLLM venv (tests/vllm/test_kimi_k25_pixels.py, tests/vllm/test_image_families.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encode_server.encoders import load_encoder
from encode_server.encoders.kimi_k25 import load_media_config, navit_size, patchify
from encode_server.fingerprints import model_fingerprint
from tests.tiny import kimi_k25
from tests.tiny_models import load_full_model, reference_kimi_k25_features
from tests.unit.encoders.util import decode, noise_image, num_parameters

# Float32 named: vLLM's auto dtype is bfloat16 on this CPU, and these compare with the float32 full model.
CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}

# (width, height): the position grid's own size (8 x 8 patches); resized down, up, tall; one pixel;
# above the patch budget (downscaled); past the side limit
SIZES = [(112, 112), (300, 200), (50, 61), (30, 400), (1, 1), (600, 500), (5000, 3)]


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Within float32 rounding: the two compute the same arithmetic in another order (fused QKV
    and RoPE on interleaved pairs here, as vLLM; permuted and half-split in transformers)."""
    return ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_rows_equal_transformers_get_image_features(kimi_k25_dir: Path) -> None:
    encoder = load_encoder(str(kimi_k25_dir), **CPU32)
    for i, (w, h) in enumerate(SIZES):
        image = noise_image(w, h, seed=i)
        [encoded] = encoder.forward([encoder.preprocess(image)])
        assert _close(decode(encoded), reference_kimi_k25_features(kimi_k25_dir, image)), (w, h)
    assert (encoder.info.kind, encoder.info.output, encoder.info.hidden_size) == ("kimi_k25", "projected", 64)


def test_a_batch_is_each_images_rows_in_order(kimi_k25_dir: Path) -> None:
    """Attention stays within each image: a batch's rows are each image's alone."""
    encoder = load_encoder(str(kimi_k25_dir), **CPU32)
    images = [noise_image(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES)]
    batched = encoder.forward([encoder.preprocess(image) for image in images])
    for image, encoded in zip(images, batched, strict=True):
        [alone] = encoder.forward([encoder.preprocess(image)])
        assert _close(decode(encoded), decode(alone))


def test_zeros_under_a_weight_change_the_rows(kimi_k25_dir: Path, tmp_path: Path) -> None:
    """Every part is read: a checkpoint whose second block's attention output is zeroed encodes
    otherwise (a loader that skipped it, or swapped two blocks, would not see the difference)."""
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(kimi_k25_dir, tmp_path / "z")
    tensors = load_file(copy / "model.safetensors")
    tensors["vision_tower.encoder.blocks.1.wo.weight"].zero_()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    image = noise_image(300, 200)
    ours, zeroed = load_encoder(str(kimi_k25_dir), **CPU32), load_encoder(str(copy), **CPU32)
    [theirs] = zeroed.forward([zeroed.preprocess(image)])
    [unchanged] = ours.forward([ours.preprocess(image)])
    assert not torch.allclose(decode(unchanged), decode(theirs))


@pytest.mark.parametrize(("width", "height"), [*SIZES, (640, 480), (168, 280), (57, 333), (1920, 1080), (27, 29)])
def test_count_tokens_is_one_row_a_merged_block_of_the_padded_grid(kimi_k25_dir: Path, width: int,
                                                                     height: int) -> None:
    encoder = load_encoder(str(kimi_k25_dir), **CPU32)
    prepared = encoder.preprocess(noise_image(width, height))
    _, rows, cols = prepared.meta["grid_thws"]
    assert prepared.inputs["patches"].shape == (rows * cols, 3, 14, 14)
    assert prepared.inputs["patches"].dtype == torch.uint8  # normalised on the device, as vLLM does
    assert rows % 2 == cols % 2 == 0 and rows * cols <= 4 * kimi_k25.IN_PATCH_LIMIT
    assert prepared.num_tokens == rows * cols // 4 == kimi_k25.num_tokens(width, height)
    assert prepared.cost_tokens == rows * cols
    assert encoder.count_tokens(width, height) == (prepared.num_tokens, prepared.meta)


def test_the_resize_never_upscales_and_pads_with_black(kimi_k25_dir: Path) -> None:
    """50 x 61 fits the budget: kept at its size, padded to 56 x 84 (whole 28-px merges) with zeros."""
    media = load_media_config(kimi_k25_dir)
    assert navit_size(50, 61, media) == (50, 61, 56, 84)
    assert navit_size(5000, 3, media) == (448, 1, 448, 28)  # 32 patches a side at most, 1 px at least
    image = noise_image(50, 61)
    patches, (rows, cols) = patchify(image, media)
    canvas = patches.view(rows, cols, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(rows * 14, cols * 14, 3)
    assert torch.equal(canvas[:61, :50], torch.from_numpy(np.array(image)))
    assert not canvas[61:].any() and not canvas[:, 50:].any()


def test_the_fingerprint_covers_the_media_config(kimi_k25_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(kimi_k25_dir, tmp_path / "m")
    config = json.loads((copy / "preprocessor_config.json").read_text())
    config["media_proc_cfg"]["in_patch_limit"] = 64
    (copy / "preprocessor_config.json").write_text(json.dumps(config))
    ours, theirs = load_encoder(str(kimi_k25_dir), **CPU32), load_encoder(str(copy), **CPU32)
    assert theirs.count_tokens(600, 500)[0] < ours.count_tokens(600, 500)[0]
    assert model_fingerprint(theirs.info) != model_fingerprint(ours.info)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("patch_size", 16, "do not match the tower"),
    ("fixed_output_tokens", 64, "fixes the output"),
])
def test_a_media_config_the_tower_cannot_follow_is_refused(kimi_k25_dir: Path, tmp_path: Path, key: str, value: Any,
                                                           message: str) -> None:
    copy = shutil.copytree(kimi_k25_dir, tmp_path / "c")
    config = json.loads((copy / "preprocessor_config.json").read_text())
    config["media_proc_cfg"][key] = value
    (copy / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_encoder(str(copy), **CPU32)


def test_a_tower_variant_not_implemented_is_refused(kimi_k25_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(kimi_k25_dir, tmp_path / "v")
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"]["mm_projector_type"] = "patchmergerv2"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mm_projector_type"):
        load_encoder(str(copy), **CPU32)


def test_holds_no_language_model(kimi_k25_dir: Path) -> None:
    encoder: Any = load_encoder(str(kimi_k25_dir), **CPU32)
    full: Any = load_full_model(kimi_k25_dir)
    vision = num_parameters(full.model.vision_tower, full.model.mm_projector)
    assert encoder.info.num_parameters == num_parameters(encoder.module) == vision < num_parameters(full)


def test_the_hubs_vision_config_keys_load_the_same_tower(kimi_k25_dir: Path, tmp_path: Path) -> None:
    """The hub's Kimi-K2.5 config.json names the position grid ``init_pos_emb_*`` (vLLM reads those
    first, and so does the server), repeats the sizes as ``vt_*`` (which neither transformers nor
    vLLM reads: the canonical names, or transformers' defaults, which are the real model's, decide)
    and adds the projector's keys: the same tower loads."""
    copy = shutil.copytree(kimi_k25_dir, tmp_path / "h")
    config = json.loads((copy / "config.json").read_text())
    vision = config["vision_config"]
    for dim in ("height", "width", "time"):
        vision[f"init_pos_emb_{dim}"] = vision.pop(f"pos_emb_{dim}")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
        vision[f"vt_{name}"] = vision[name]
    vision.update(merge_type="sd2_tpool", mm_projector_type="patchmerger", pos_emb_type="divided_fixed",
                  video_attn_type="spatial_temporal", projector_ln_eps=1e-5, projector_hidden_act="gelu",
                  mm_hidden_size=vision["hidden_size"], text_hidden_size=config["text_config"]["hidden_size"])
    (copy / "config.json").write_text(json.dumps(config))
    image = noise_image(300, 200)
    ours, hubs = load_encoder(str(kimi_k25_dir), **CPU32), load_encoder(str(copy), **CPU32)
    [a], [b] = ours.forward([ours.preprocess(image)]), hubs.forward([hubs.preprocess(image)])
    assert torch.equal(decode(a), decode(b))
