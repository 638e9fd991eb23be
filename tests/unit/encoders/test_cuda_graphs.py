"""CUDA graphs at token budgets: what runs without a GPU (budgets, packing, padding, the dispatch
and the fallback), with a CPU stand-in for a captured graph that replays the recorded call on its
buffers. The capture itself needs CUDA: bench/gpu_check.sh runs it on a lent GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encode_server.config import settings_from
from encode_server.encoders import load_encoder
from encode_server.encoders.cuda_graphs import Budget, TowerGraphs, budgets, fitting, pack
from encode_server.encoders.varlen import Layout, segments
from tests.unit.encoders.util import noise_image

SIZES = [(300, 40), (640, 480), (45, 200), (101, 99)]


def test_budgets_are_powers_of_two_up_to_the_largest() -> None:
    assert budgets(16384) == (1024, 2048, 4096, 8192, 16384)
    assert budgets(3000) == (1024, 2048, 3000)
    assert budgets(1026, unit=4) == (1024,)  # rounded down to whole merged units
    assert budgets(512) == (512,)
    assert budgets(0) == ()


def test_a_pass_takes_the_smallest_budget_that_holds_it() -> None:
    assert fitting((1024, 2048, 4096), 1024) == 1024
    assert fitting((1024, 2048, 4096), 1025) == 2048
    assert fitting((1024, 2048, 4096), 4097) is None


def test_packs_keep_order_and_an_oversized_item_alone() -> None:
    assert pack([400, 500, 300, 900, 5000, 100], 1024) == [[0, 1], [2], [3], [4], [5]]
    assert pack([512, 512, 512], 1024) == [[0, 1], [2]]
    assert pack([], 1024) == []


class _CpuGraph:
    """A captured graph's stand-in: ``replay`` runs the recorded call on the same buffers."""

    def __init__(self, graphs: TowerGraphs, pixels: torch.Tensor, kwargs: dict[str, Any], grid: torch.Tensor,
                 output: torch.Tensor) -> None:
        self.call = lambda: graphs.features(pixels, grid, **kwargs)
        self.kwargs, self.output = kwargs, output

    def replay(self) -> None:
        layouts = {id(t): Layout.of(t.tolist()) for k, t in self.kwargs.items() if k.startswith("cu_")}
        with torch.inference_mode(), segments(layouts):
            self.output.copy_(self.call())


def _stand_in(encoder: Any, sizes: tuple[int, ...]) -> TowerGraphs:
    weight = encoder.module.get_submodule("patch_embed").proj.weight
    graphs = TowerGraphs(encoder.features, encoder.grid_plan, device=encoder.device, dtype=encoder.dtype,
                         width=int(np.prod(weight.shape[1:])), sizes=sizes)
    for rows in graphs.sizes:
        pixels, kwargs, grid = graphs.buffers(rows)
        layouts = {id(t): Layout.of(t.tolist()) for k, t in kwargs.items() if k.startswith("cu_")}
        with torch.inference_mode(), segments(layouts):
            output = graphs.features(pixels, grid, **kwargs).clone()
        graph = _CpuGraph(graphs, pixels, kwargs, grid, output)
        graphs.captured[rows] = Budget(rows, pixels, kwargs, graph, output)
    return graphs


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen2_5_omni"])
def test_a_padded_replay_gives_the_eager_passs_rows(kind: str, request: pytest.FixtureRequest) -> None:
    """Every pack through the budget buffers (padding as a segment of its own, empty slots, the
    window and position tables padded) answers what the eager pass answers for its rows."""
    encoder: Any = load_encoder(str(request.getfixturevalue(f"{kind}_dir")), device="cpu", dtype="float32")
    batch = [encoder.preprocess(noise_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    eager = encoder.forward(batch)
    costs = sorted(item.cost_tokens for item in batch)
    unit = encoder.merge_size**2
    largest = costs[-2]  # the largest image is above it (eager), the rest go in packs of two budgets
    encoder.graphs = _stand_in(encoder, (largest // 2 // unit * unit, largest))
    assert sum(costs[:-1]) > largest
    replayed = encoder.forward(batch)
    assert encoder.graphs.replays >= 2 and encoder.graphs.eager >= 1
    for a, b in zip(eager, replayed, strict=True):  # equal but for the rounding of longer matmuls
        assert a.shape == b.shape
        x, y = (torch.frombuffer(bytearray(e.data), dtype=torch.float32) for e in (a, b))
        assert (x - y).abs().max() <= 1e-5 * x.abs().max()


def test_graphs_are_used_only_on_cuda_in_half_precision(qwen_dir: Path, glm4v_dir: Path) -> None:
    assert not load_encoder(str(qwen_dir), device="cpu", dtype="bfloat16", cuda_graph_tokens=4096).graphs
    assert load_encoder(str(qwen_dir), device="cpu", dtype="float32").use_graphs(4096) is False
    assert load_encoder(str(glm4v_dir), device="cpu", dtype="float32").graphs_allowed is False


def test_the_flags_turn_them_off_and_bound_them() -> None:
    assert settings_from([]).cuda_graphs is True
    assert settings_from(["--no-cuda-graphs"]).cuda_graphs is False
    assert settings_from(["--cuda-graph-max-tokens", "4096"]).cuda_graph_max_tokens == 4096
    with pytest.raises(SystemExit, match="--cuda-graph-max-tokens"):
        settings_from(["--cuda-graph-max-tokens", "-1"])
