"""Forward passes side by side on a CPU: how many, and how many of torch's threads each gets.

On a CPU one forward pass split over every core leaves cores idle: a vision tower runs thousands
of small operators (a 640x480 image through a Qwen2.5-VL tower: 434 attention calls, most over 16
patches), each too small to split, and between them torch's other threads wait. Passes side by
side, each on its own share of the cores, keep every core on work of its own, as Triton's model
instances and OpenVINO's throughput streams do (the figures: docs/benchmarks.md, "What each change
bought").

Passes side by side pay only where the tower is the work. Where decoding and preprocessing an image
cost more than its forward pass (a small CLIP: the preprocessing threads already keep the cores
busy), a second pass only halves the batches and takes cores from the preprocessing threads, so
``--forward-workers 0`` keeps one pass there, measured at start (``auto_passes``, ``warmup.py``'s
``choose_passes``; the runs behind it: docs/benchmark-history.md, "Serving runs").

A lone pass still gets every core, so one request's latency is what it was: torch's thread count
is process-wide (``torch.set_num_threads``; measured: a pass running in one thread follows a count
set in another), so it is set to ``cores // passes running`` whenever a pass starts or ends, and a
pass already running takes the new count at its next operator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

__all__ = ["FORWARD_SHARE", "MAX_AUTO_WORKERS", "CoreShare", "auto_passes", "forward_workers"]

T = TypeVar("T")
R = TypeVar("R")

# The most passes side by side that ``--forward-workers 0`` picks on a CPU: measured on 2 cores
# only; beyond a few, each pass's Python (under the GIL) and activations grow with the count.
MAX_AUTO_WORKERS = 4
# The forward pass's share of an image's decode and preprocessing from which passes run side by
# side: between the tiny CLIP's 0.49 (one pass better) and the built-in tower's 3.2 (two better).
FORWARD_SHARE = 1.0


def forward_workers(requested: int, device: str, *, batched: bool = False) -> int:
    """``--forward-workers``, or (0) one per core torch may use, at most ``MAX_AUTO_WORKERS``, on a
    CPU; one on an accelerator, whose passes queue on one device anyway. The batched pipeline
    (``--preprocess-device model``) runs one pass at a time: its copies share one side stream."""
    if batched:
        if requested > 1:
            raise ValueError("--forward-workers above 1 needs --preprocess-device cpu (the batched pipeline runs "
                             "one pass at a time)")
        return 1
    if requested:
        return requested
    if device != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), MAX_AUTO_WORKERS))


def auto_passes(passes: int, forward_s: float, prepare_s: float) -> int:
    """How many of ``passes`` (``forward_workers``' count) ``--forward-workers 0`` keeps once a
    typical image's lone forward pass (``forward_s``, every core) and its decode and preprocessing
    (``prepare_s``) were timed: all of them where the pass takes at least ``FORWARD_SHARE`` of the
    preprocessing, else one (module docstring)."""
    return passes if forward_s >= FORWARD_SHARE * prepare_s else 1


class CoreShare(Generic[T, R]):
    """``forward`` with torch's threads shared among the passes running at once: ``cores //
    running`` (at least one), set as each pass starts and ends. ``cores``: torch's count at start
    (the usable cores, or what ``OMP_NUM_THREADS`` / ``torch.set_num_threads`` said)."""

    def __init__(self, forward: Callable[[Sequence[T]], Sequence[R]], cores: int | None = None) -> None:
        self._forward = forward
        self.cores = cores or torch.get_num_threads()
        self._lock = threading.Lock()
        self.running = 0

    def __call__(self, batch: Sequence[T]) -> Sequence[R]:
        self._enter(1)
        try:
            return self._forward(batch)
        finally:
            self._enter(-1)

    def _enter(self, change: int) -> None:
        with self._lock:
            self.running += change
            threads = max(1, self.cores // max(1, self.running))
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
