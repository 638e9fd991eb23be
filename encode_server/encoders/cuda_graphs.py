"""CUDA graphs of a Qwen-style tower's forward at token budgets, as vLLM's encoder graph manager.

With one attention call per layer and no host sync (``varlen.py``), a tower's whole pass can be
recorded once and replayed as one launch instead of hundreds. A graph has fixed shapes, so passes
are padded to token budgets:

- **Budgets**: powers of two of patch rows from ``SMALLEST_BUDGET`` up to ``--cuda-graph-max-tokens``
  (which is one too). A budget of B rows has B / merge² segment slots: every frame and every
  window covers at least one merged unit, so whatever fits the rows fits the slots.
- **Padding** (``GridPlan.host(budget=...)``): a pass's rows go first; the padding rows are a
  segment of their own in every attention (and windows of their own), so no real row sees them;
  unused slots are empty segments. The first N / merge² output rows are the pass's.
- **Packing**: a pass over more rows than the largest budget is cut, item by item in order, into
  packs that each fit it; an item above it alone runs eagerly.
- **Dispatch**: the smallest budget that holds a pack replays its graph; the rest runs eagerly:
  everything off CUDA, a float32 tower (the varlen kernel takes half precision only), a family whose
  forward reads its grid beyond what the plan precomputes (GLM-4.1V: ``graphs_allowed``).

Capture runs in the warm-up (``capture``: every budget, largest first, one memory pool), so the
graphs' memory is in the warm-up's peak. Only ``plan``, ``pack`` and the padding run without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .varlen import Grid, GridPlan

__all__ = ["SMALLEST_BUDGET", "Budget", "TowerGraphs", "budgets", "fitting", "pack"]

SMALLEST_BUDGET = 1024  # patch rows: one small image (a 448x448 Qwen image is 1,024 patches)

Features = Callable[..., torch.Tensor]


def budgets(largest: int, smallest: int = SMALLEST_BUDGET, unit: int = 4) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``largest``, then ``largest`` (rounded down to whole
    merged units); empty when ``largest`` is below one unit."""
    largest -= largest % unit
    out = []
    b = smallest
    while b < largest:
        out.append(b)
        b *= 2
    return (*out, largest) if largest > 0 else ()


def fitting(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest budget of ``sizes`` (ascending) holding ``rows``; None when none does."""
    return next((b for b in sizes if b >= rows), None)


def pack(costs: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive items (their indices) in packs of at most ``limit`` rows; an item above the
    limit is a pack alone (run eagerly)."""
    packs: list[list[int]] = []
    rows = 0
    for i, cost in enumerate(costs):
        if packs and rows + cost <= limit:
            packs[-1].append(i)
            rows += cost
        else:
            packs.append([i])
            rows = cost
    return packs


@dataclass
class Budget:
    """One captured graph: its static input buffers (copied into before a replay) and output."""

    rows: int
    pixels: torch.Tensor
    kwargs: dict[str, Any]
    graph: Any
    output: torch.Tensor


class TowerGraphs:
    """A tower's graphs, one per budget. ``features(pixel_values, grid_thw, **precomputed)`` is the
    encoder's eager call; ``width``: a pixel row's values (channels x temporal x patch x patch)."""

    def __init__(self, features: Features, plan: GridPlan, *, device: torch.device, dtype: torch.dtype,
                 width: int, sizes: Sequence[int]) -> None:
        self.features = features
        self.plan = plan
        self.device = device
        self.dtype = dtype
        self.width = width
        self.sizes = tuple(sorted(sizes))
        self.unit = plan.merge_size**2
        self.captured: dict[int, Budget] = {}
        self.replays = 0
        self.eager = 0

    def capture(self) -> int:
        """Record every budget's graph (largest first, one pool); the bytes the device holds for
        them, which the warm-up's peak includes."""
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        for rows in reversed(self.sizes):
            budget = self._capture(rows, pool)
            pool = budget.graph.pool()
            self.captured[rows] = budget
        return torch.cuda.memory_reserved(self.device) - before

    def buffers(self, rows: int) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
        """A budget's static inputs: pixel rows, the plan's keywords (a small pass padded to the
        budget; the maxima are the budget) and a grid the forward does not read."""
        side = self.plan.merge_size
        arrays, bounds, maxima = self.plan.host([(1, side, side)], budget=rows, slots=rows // self.unit)
        pixels = torch.zeros(rows, self.width, device=self.device, dtype=self.dtype)
        kwargs: dict[str, Any] = {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}
        kwargs.update({k: torch.from_numpy(v.astype(np.int32)).to(self.device) for k, v in bounds.items()})
        kwargs.update(maxima)
        return pixels, kwargs, torch.tensor([[1, side, side]], device=self.device)

    def _capture(self, rows: int, pool: Any) -> Budget:
        pixels, kwargs, grid = self.buffers(rows)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):  # warm the kernels outside the capture
            self.features(pixels, grid, **kwargs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            output = self.features(pixels, grid, **kwargs)
        return Budget(rows, pixels, kwargs, graph, output)

    def run(self, pixels: torch.Tensor, grids: Sequence[Grid], eager: Callable[[torch.Tensor, Sequence[Grid]],
                                                                                torch.Tensor]) -> torch.Tensor:
        """The pass's output rows: each pack through the smallest graph that holds it, a pack no
        graph holds through ``eager(pixels, grids)``."""
        costs = [t * h * w for t, h, w in grids]
        outs, start = [], 0
        for members in pack(costs, self.sizes[-1] if self.sizes else 0):
            rows = sum(costs[i] for i in members)
            part, part_grids = pixels[start : start + rows], [grids[i] for i in members]
            start += rows
            size = fitting(self.sizes, rows)
            if size is None or size not in self.captured:
                self.eager += 1
                outs.append(eager(part, part_grids))
            else:
                outs.append(self._replay(self.captured[size], part, part_grids))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _replay(self, budget: Budget, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        arrays, bounds, _ = self.plan.host(grids, budget=budget.rows, slots=budget.rows // self.unit)
        n = pixels.shape[0]
        budget.pixels[:n].copy_(pixels, non_blocking=True)
        budget.pixels[n:].zero_()
        for name, values in arrays.items():
            budget.kwargs[name].copy_(torch.from_numpy(values), non_blocking=True)
        for name, values in bounds.items():
            budget.kwargs[name].copy_(torch.from_numpy(values.astype(np.int32)), non_blocking=True)
        budget.graph.replay()
        self.replays += 1
        return budget.output[: n // self.unit].clone()  # the next replay overwrites the buffer
