"""The startup heap, frozen out of Python's garbage collector, and the collector's pauses, measured.

A loaded model leaves hundreds of thousands of objects the cyclic collector tracks (transformers'
and torch's modules, the model's parameters and submodules: 435,000 for a tiny CLIP with the
server's imports). None of them will ever be garbage, yet each full (generation 2) collection walks
them all, holding the GIL: 100-190 ms on a 2-core machine, during which no request is parsed,
answered or handed to a forward pass. Under load such a collection comes every few hundred
requests (objects alive across younger collections, a request's, count towards the next full one)
and stretches the 16 requests in flight at once: the tail of a closed loop was clumps of 16.
``freeze_startup_heap`` moves everything alive once the warm-up is done into the permanent
generation (``gc.freeze``), as vLLM does after its start (``vllm.utils.gc_utils.freeze_gc_heap``):
full collections then walk only what serving made. Reference counting still frees a frozen object
that loses its last reference; only a cycle among frozen objects would outlive its use.

``GcPauses`` times every collection (``gc.callbacks``) into ``encode_server_gc_pause_seconds``,
so an operator sees a pause in the tail where it is.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

__all__ = ["GcPauses", "freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect what the start left as garbage, then freeze what is alive; the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Calls ``observe(generation, seconds)`` after every collection of the cyclic collector, from
    the thread that ran it, while installed. Process-wide (``gc.callbacks``): installed by one
    server and removed when it closes."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # The collector holds the GIL from "start" to "stop" and does not nest, so one start time
        # serves every thread.
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(int(info["generation"]), time.perf_counter() - self._started)
