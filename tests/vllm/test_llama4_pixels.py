"""Llama 4's tiles as encode-server makes them (``encoders/llama4.py``, torch alone) equal, bit for
bit, what transformers' torchvision-only ``Llama4ImageProcessor`` makes in vLLM's environment: the
canvas, the resize, the padding, the bfloat16 normalisation, the tile order and the global tile.

The server's venv has no torchvision, so this is where its pixels meet the processor vLLM runs;
tests/unit/encoders/test_llama4.py then runs the full model on them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny.llama4 import make_tiny_llama4
from tests.vllm.conftest import pil, png, tiny_checkpoint
from tests.vllm.families import PARITY_SIZES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_llama4)


@pytest.mark.parametrize("resize_to_max_canvas", [False, True])
def test_llama4_tiles_equal_the_torchvision_processors(checkpoint: Path, resize_to_max_canvas: bool) -> None:
    import torch
    from transformers import AutoImageProcessor

    from encode_server.encoders.llama4 import load_tiling, tile_image

    processor = AutoImageProcessor.from_pretrained(checkpoint)
    tiling = load_tiling(checkpoint)
    tiling.resize_to_max_canvas = resize_to_max_canvas
    rng = np.random.default_rng(7)
    sizes = [*PARITY_SIZES, *((int(w), int(h)) for w, h in rng.integers(1, 700, size=(60, 2)))]
    wrong = []
    for i, (w, h) in enumerate(sizes):
        image = pil(png(w, h, seed=i))
        theirs = processor(images=[image], return_tensors="pt", resize_to_max_canvas=resize_to_max_canvas)
        ours, grid = tile_image(image, tiling)
        same = ours.shape == theirs["pixel_values"].shape and torch.equal(ours, theirs["pixel_values"])
        if not same or list(grid) != theirs["aspect_ratios"][0].tolist():
            wrong.append((w, h))
    assert not wrong, f"tiles differ from Llama4ImageProcessor's for {wrong}"
