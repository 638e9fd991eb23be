"""Images decoded and preprocessed in worker processes (``--preprocess-processes``).

In the server's own process, decoding and preprocessing run on threads: Pillow's decode and resize
release the GIL, but its Python (the JPEG header's markers, the plugin, ``tobytes``) and the image
processor's do not, and on a many-core GPU host the GIL, not the cores, then bounds what one process
serves. Worker processes take that work off the server's GIL, as vLLM's API-server processes keep
preprocessing away from the engine's loop.

Each worker holds the encoder's host twin (``Encoder.host_twin``: the encoder without its weights,
pickled once at start), so its inputs are exactly what the thread path makes. Inputs come back
through shared memory (torch's reductions for ``multiprocessing``), not pickled into the pipe. The
memory charge, the per-request-settings path and a device pipeline stay in the server's process.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import pickle
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
import torch.multiprocessing  # registers the shared-memory reductions of tensors
from PIL import Image

from encode_server.core.errors import BadInput, EncodeServerError, Unavailable
from encode_server.encoders.base import Encoder, PreparedItem
from encode_server.imaging import decode_image

__all__ = ["PreprocessProcesses"]

log = logging.getLogger(__name__)

_twin: Encoder | None = None  # a worker's encoder, without weights


def _install(payload: bytes) -> None:
    """A worker's start: one torch thread (the pool's width is the parallelism), its twin unpickled."""
    global _twin
    torch.set_num_threads(1)
    _twin = pickle.loads(payload)


def _prepare(data: bytes, max_pixels: int, index: int) -> PreparedItem | EncodeServerError:
    """In a worker: ``kinds.image_inputs``'s host path. A refusal comes back as a value (an error
    raised in a worker would come back with the worker's traceback, which holds the bytes)."""
    assert _twin is not None
    try:
        return _twin.preprocess(decode_image(data, max_pixels=max_pixels, index=index))
    except EncodeServerError as exc:
        exc.__traceback__ = None
        return exc
    except ValueError as exc:  # what ImageKind answers for an image the processor refuses
        return BadInput(f"image cannot be preprocessed: {exc}", type="unsupported_image", index=index)


def _ready() -> bool:
    return _twin is not None


def _same(a: PreparedItem, b: PreparedItem) -> bool:
    if (a.num_tokens, a.cost_tokens, a.meta, a.inputs.keys()) != (b.num_tokens, b.cost_tokens, b.meta, b.inputs.keys()):
        return False
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else bool(x == y)
        for x, y in ((a.inputs[k], b.inputs[k]) for k in a.inputs)
    )


class PreprocessProcesses:
    """``count`` spawned workers, each with ``encoder``'s host twin. ``prepare`` blocks its caller
    (a preprocessing thread, GIL released while it waits) until a worker has made the inputs."""

    def __init__(self, encoder: Encoder, count: int) -> None:
        twin = encoder.host_twin()
        if twin is None:
            raise ValueError(f"{encoder.info.kind} cannot preprocess in worker processes (it has no host twin)")
        self.count = count
        self._payload = pickle.dumps(twin, protocol=pickle.HIGHEST_PROTOCOL)
        self._lock = threading.Lock()
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_install, initargs=(self._payload,))

    def start(self, encoder: Encoder) -> None:
        """Every worker started and its twin loaded, before the first request waits for it; then
        a probe image's inputs from a worker checked against ``encoder``'s own (``ValueError``
        where they differ: that family's preprocessing needs what its twin left behind)."""
        for ready in [self._pool.submit(_ready) for _ in range(self.count)]:
            if not ready.result(timeout=300):
                raise RuntimeError("a preprocessing process did not load its encoder")
        probe = io.BytesIO()
        Image.new("RGB", (96, 64), (120, 30, 200)).save(probe, "PNG")
        data = probe.getvalue()
        here = encoder.preprocess(decode_image(data, max_pixels=96 * 64))
        there = self.prepare(data, max_pixels=96 * 64, index=0)
        if not _same(here, there):
            raise ValueError(f"{encoder.info.kind}: a worker process's inputs differ from the server's")

    def prepare(self, data: bytes, *, max_pixels: int, index: int) -> PreparedItem:
        pool = self._pool
        try:
            outcome: Any = pool.submit(_prepare, data, max_pixels, index).result()
        except BrokenProcessPool:  # a worker died (killed, out of memory): every call in flight fails
            self._replace(pool)
            raise Unavailable("a preprocessing process died; retry", type="overloaded", index=index,
                              retry_after=1.0) from None
        if isinstance(outcome, EncodeServerError):
            raise outcome
        return outcome

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """A new pool for the broken one (once, whichever caller sees it first): the requests in
        flight were answered 503, the next ones are served."""
        with self._lock:
            if self._pool is broken:
                log.error("a preprocessing process died: starting %d new ones", self.count)
                self._pool = self._new_pool()
                broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
