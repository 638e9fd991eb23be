"""Variable-length towers: one attention call per layer, no host sync, the loop's rows exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import vision_utils

from bench.tower_ops import count, device_counts
from encode_server.encoders import load_encoder
from encode_server.encoders.qwen import QwenVisionEncoder
from encode_server.encoders.varlen import ATTENTION, GridPlan, Layout, attend, segments
from tests.tiny.records import RECORDS
from tests.unit.encoders.util import decode, noise_image

# window edges, equal sizes, a lone short one, an empty segment (transformers' windows drop them)
LENGTHS = [64, 48, 64, 16, 0, 12, 64, 48]
# a mixed pass: two sizes, one repeated, and odd ones (grids differ in both sides)
SIZES = [(300, 40), (640, 480), (45, 200), (640, 480), (101, 99)]


def _loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """transformers' sdpa path: one call per segment."""
    out, start = [], 0
    for n in lengths:
        one = [t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out.append(F.scaled_dot_product_attention(*one)[0].transpose(0, 1))
        start += n
    return torch.cat(out)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_is_the_per_segment_loop_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 4, 16).to(dtype) for _ in range(3))
    cu = _cu(LENGTHS)
    with segments({id(cu): Layout.of(cu.tolist())}):
        out, counts = count(lambda: attend(q, k, v, cu, max(LENGTHS)))
    assert torch.equal(out, _loop(q, k, v, LENGTHS))
    assert counts.attention_calls == len({n for n in LENGTHS if n}) and counts.syncs == 0


def test_equal_segments_take_one_call_and_no_index_op() -> None:
    layout = Layout.of([0, 64, 128, 192])
    assert layout.calls == 1 and layout.scatter is None
    q = torch.randn(192, 2, 8)
    cu = _cu([64, 64, 64])
    with segments({id(cu): layout}):
        out, counts = count(lambda: attend(q, q, q, cu, 64))
    assert torch.equal(out, _loop(q, q, q, [64, 64, 64]))
    assert counts.attention_calls == 1
    groups, scatter = layout.on(torch.device("cpu"))
    assert scatter is None and [gather for gather, _, _ in groups] == [None]  # no gather, no scatter


def test_a_pass_without_a_plan_reads_its_segments_from_the_tensor() -> None:
    q = torch.randn(30, 2, 8)
    assert torch.equal(attend(q, q, q, _cu([10, 20]), 20), _loop(q, q, q, [10, 20]))


def _grids() -> list[tuple[int, int, int]]:
    return [(1, 34, 46), (2, 16, 20), (1, 4, 4), (1, 34, 46), (3, 10, 30)]


def test_the_grid_plan_is_what_transformers_computes_for_the_whole_pass() -> None:
    grids = _grids()
    thw = torch.tensor(grids)
    interpolation = {"num_grid_per_side": 8, "mode": "bilinear", "align_corners": True}
    plan = GridPlan(2, windows=(112, 14), interpolation=interpolation).inputs(grids, torch.device("cpu"))
    made = plan.kwargs
    index, windows = vision_utils.get_vision_window_index(thw, spatial_merge_size=2, window_size=112, patch_size=14)
    indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(thw, spatial_merge_size=2,
                                                                                 **interpolation)
    expected = {
        "position_ids": vision_utils.get_vision_position_ids(thw, 2),
        "cu_seqlens": vision_utils.get_vision_cu_seqlens(thw),
        "window_index": index, "cu_window_seqlens": windows, "interp_indices": indices, "interp_weights": weights,
    }
    for key, tensor in expected.items():
        assert torch.equal(made[key], tensor), key
    assert made["max_seqlen"] == 34 * 46
    assert made["max_window_seqlen"] == int((windows[1:] - windows[:-1]).max())
    assert set(plan.layouts) == {id(made["cu_seqlens"]), id(made["cu_window_seqlens"])}


def _varlen_encoder(path: Path) -> Any:
    encoder = load_encoder(str(path), device="cpu", dtype="float32")
    if not isinstance(encoder, QwenVisionEncoder):
        pytest.skip(f"{type(encoder).__name__}: not a Qwen-style variable-length tower")
    return encoder


@pytest.mark.parametrize("kind", sorted(kind for record in RECORDS.values() for kind in record.builders))
def test_every_variable_length_tower_gives_the_loops_rows_in_one_call_per_layer(
        kind: str, request: pytest.FixtureRequest) -> None:
    """The plan and the one-call path against the tower's own: transformers' sdpa loop and its own
    grid computations, on a mixed pass, bit for bit."""
    encoder = _varlen_encoder(request.getfixturevalue(f"{kind}_dir"))
    tower = encoder.module
    assert tower.config._attn_implementation == ATTENTION
    batch = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    encoder.forward(batch)
    new, counts = count(lambda: encoder.forward(batch))
    depth = len(tower.blocks)
    assert counts.syncs == 0
    assert depth <= counts.attention_calls <= depth * 8  # one per distinct segment length
    tower.config._attn_implementation_internal = "sdpa"
    encoder.grid_plan.supported = False
    old = encoder.forward(batch)
    for a, b in zip(new, old, strict=True):
        assert torch.equal(decode(a), decode(b))


def test_the_gpu_path_makes_one_attention_call_per_layer_and_no_sync(qwen_dir: Path) -> None:
    """Counted on the meta device, where the forward takes the ``varlen_attn`` kernel's path."""
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    batch = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    counts = device_counts(encoder, batch)
    assert counts["attention_calls"] == len(encoder.module.blocks)
    assert counts["syncs"] == 0


def test_kimi_k25_attends_each_image_alone_in_one_call_per_length(kimi_k25_dir: Path) -> None:
    """MoonViT (written here, not transformers'): a mixed pass gives each image's rows as a pass of
    that image alone does, with one attention call per distinct length per layer and no sync."""
    encoder: Any = load_encoder(str(kimi_k25_dir), device="cpu", dtype="float32")
    batch = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    together, counts = count(lambda: encoder.forward(batch))
    depth = len(encoder.module.vision_tower.encoder.blocks)
    lengths = {item.meta["grid_thws"][1] * item.meta["grid_thws"][2] for item in batch}
    assert counts.attention_calls == depth * len(lengths) and counts.syncs == 0
    for item, rows in zip(batch, together, strict=True):
        [alone] = encoder.forward([item])
        torch.testing.assert_close(decode(rows), decode(alone), rtol=0, atol=1e-6)
