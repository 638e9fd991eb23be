"""Kimi-K2.5's pixels as encode-server makes them (``encoders/kimi_k25.py``) equal, bit for bit,
what vLLM 0.32's own processor makes (``KimiK25FusedVisionProcessor``, numba, which the server's
venv does not have): the NaViT resize, the zero padding, the patch order and the grid; and the
normalisation equals vLLM's on-device one (``FusedMMInputNorm``, the path vLLM takes by default
for this model), so the tower starts from the same floats.

tests/unit/encoders/test_kimi_k25.py runs the tower on these patches against transformers', and
tests/vllm/test_image_families.py compares the rows with vLLM's own tower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tiny.kimi_k25 import make_tiny_kimi_k25
from tests.vllm.conftest import pil, png, tiny_checkpoint
from tests.vllm.families import PARITY_SIZES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_kimi_k25)


def test_kimi_patches_and_grid_equal_vllms_processors(checkpoint: Path) -> None:
    import torch
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    from encode_server.encoders.kimi_k25 import load_media_config

    processor = KimiK25FusedVisionProcessor.from_pretrained(str(checkpoint))
    media = load_media_config(checkpoint)
    rng = np.random.default_rng(7)
    sizes = [*PARITY_SIZES, *((int(w), int(h)) for w, h in rng.integers(1, 900, size=(60, 2)))]
    wrong = []
    for i, (w, h) in enumerate(sizes):
        image = pil(png(w, h, seed=i))
        # as vLLM calls it by default for this model: normalisation left to the device (uint8 out)
        theirs = processor.preprocess([{"type": "image", "image": image}], return_tensors="pt",
                                      do_rescale=False, do_normalize=False)
        ours = media(image)
        if not (torch.equal(ours["pixel_values"], theirs["pixel_values"])
                and torch.equal(ours["grid_thws"], theirs["grid_thws"])):
            wrong.append((w, h))
    assert not wrong, f"patches differ from KimiK25FusedVisionProcessor's for {wrong}"


def test_kimi_normalisation_equals_vllms_device_norm(checkpoint: Path) -> None:
    """Every uint8 value in every channel: the server's float32 pixels equal vLLM's
    ``FusedMMInputNorm.forward_native`` (its CPU path; CUDA's Triton kernel computes the same
    ``x * w + b`` in float32), built from the checkpoint's ``media_proc_cfg`` as vLLM builds it."""
    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm, build_mm_input_norm

    from encode_server.encoders import load_encoder

    model = ModelConfig(model=str(checkpoint), dtype="float32")
    with set_current_vllm_config(VllmConfig(model_config=model)):  # a CustomOp is built under one
        norm = build_mm_input_norm(model)
    assert isinstance(norm, FusedMMInputNorm), "vLLM 0.32 normalises Kimi-K2.5's pixels on the device by default"
    encoder: Any = load_encoder(str(checkpoint), device="cpu", dtype="float32")
    patches = torch.arange(256, dtype=torch.uint8).view(256, 1, 1, 1).expand(256, 3, 14, 14).contiguous()
    theirs = norm.forward_native(patches.flatten(1), torch.float32).view(patches.shape)
    ours = encoder.normalise(patches)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_kimi_bfloat16_rows_equal_vllms_tower_bit_for_bit(checkpoint: Path) -> None:
    """vLLM's ``auto`` on this CPU: a bfloat16 engine and the server's bfloat16 tower give the same
    rows to the last bit, resampled position grids and a downscaled image included: the
    normalisation's weights cast with the tower (2/255 in bfloat16), the patch projection as a
    matmul, the grid resampled in float32 and rounded once, RoPE from ``polar``'s table, attention
    over one image a batch."""
    import torch

    from encode_server.encoders import load_encoder
    from tests.unit.encoders.util import decode
    from tests.vllm.conftest import engine
    from tests.vllm.kimi_oracle import KIMI_ENGINE_ARGS, tower_rows

    images = [pil(png(w, h, seed=i)) for i, (w, h) in enumerate([(112, 112), (300, 200), (30, 400), (600, 500)])]
    with engine(checkpoint, tower=True, dtype="bfloat16", **KIMI_ENGINE_ARGS) as llm:
        theirs = [tower_rows(llm, image) for image in images]
    encoder: Any = load_encoder(str(checkpoint), device="cpu", dtype="bfloat16")
    ours = encoder.forward([encoder.preprocess(image) for image in images])
    for image, encoded, rows in zip(images, ours, theirs, strict=True):
        mine = decode(encoded).float()
        assert torch.equal(mine, rows), (image.size, float((mine - rows).abs().max()))
