"""The variable-length tower path on this device (``encoders/varlen.py``: one attention call per
layer, the ``varlen_attn`` kernel on CUDA) and its CUDA graphs (``encoders/cuda_graphs.py``)
against the eager CPU float32 rows. In the rehearsal (CPU) the graph test has no CUDA to capture
on; ``bench/gpu_check.sh`` runs it on the lent GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tower_ops import count
from encode_server.encoders import load_encoder
from tests.gpu.conftest import DEVICES
from tests.images import rgb_image

SIZES = [(300, 40), (224, 224), (45, 200), (224, 224), (101, 99)]


def _rows(encoder: Any, batch: list[Any]) -> list[torch.Tensor]:
    out = encoder.forward(batch)
    return [torch.frombuffer(bytearray(e.data), dtype=getattr(torch, e.dtype)).reshape(e.shape).float() for e in out]


def _batch(encoder: Any) -> list[Any]:
    return [encoder.preprocess(rgb_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], limit: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).norm() / b.norm() <= limit


@pytest.mark.parametrize("device", DEVICES)
def test_one_attention_call_per_layer_and_no_sync_on_the_device(device: str, family_dirs: dict[str, Path]) -> None:
    path = str(family_dirs["qwen2_5_vl"])
    reference = load_encoder(path, device="cpu", dtype="float32")
    encoder: Any = load_encoder(path, device=device, dtype="bfloat16")
    batch = _batch(reference)
    encoder.forward(batch)
    rows, counts = count(lambda: _rows(encoder, batch))
    depth = len(encoder.module.blocks)
    on_kernel = device == "cuda"
    assert counts.attention_calls == depth if on_kernel else depth <= counts.attention_calls <= 4 * depth
    assert counts.syncs <= (1 if on_kernel else 0)  # on CUDA: reading the output back, once
    _close(rows, _rows(reference, batch), 0.02)  # bfloat16 against float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA (bench/gpu_check.sh on a GPU)")
def test_cuda_graph_replays_give_the_eager_rows(family_dirs: dict[str, Path]) -> None:
    path = str(family_dirs["qwen2_5_vl"])
    eager: Any = load_encoder(path, device="cuda", dtype="bfloat16")
    graphed: Any = load_encoder(path, device="cuda", dtype="bfloat16", cuda_graph_tokens=2048)
    assert graphed.graphs is not None
    line = graphed.capture_graphs()
    assert line is not None and "budgets" in line, line
    batch = _batch(eager)
    _close(_rows(graphed, batch), _rows(eager, batch), 0.01)
    assert graphed.graphs.replays >= 1
    one = batch[:1]  # a lone image: the graph's whole point
    _close(_rows(graphed, one), _rows(eager, one), 0.01)
