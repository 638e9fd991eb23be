"""What the service lets in before it does the work, and what it charges while the work runs.

Each check comes before the cost it bounds, and refuses with the errors a client already knows
(``core/errors.py``: 503 ``overloaded`` with ``Retry-After``):

- :class:`QueueBound`: ``--max-queue``, the items pending encode, admitted all or none per request;
- :class:`MemoryCharge`: the request-memory budget (``--max-inflight-mb``) charged with what
  decoding one item holds, from its header, before it is decoded.

What an item's header says and what its family makes of it (a video's sampling, an audio file's
length) is its kind's (``kinds/``), which charges :class:`MemoryCharge`; the service owns single
flight and the tiers and admits through :class:`QueueBound`. Neither is asked by this module
(``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from encode_server.core.budget import ByteBudget
from encode_server.core.errors import Unavailable
from encode_server.imaging import decoded_nbytes
from encode_server.metrics import Metrics

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["Charge", "MemoryCharge", "QueueBound"]


class QueueBound:
    """``--max-queue``: the items pending encode over all requests (admitted and not yet encoded:
    decoding, queued for a batch or in a forward pass), so that work stays bounded however fast
    requests arrive.

    The unit is the item, one cache key's encode, counted once, here. A long video is encoded as
    several parts (``Encoder.split``), but how many is known only once it is decoded and
    preprocessed, after the work this bound is there to refuse; so a video's parts ride on its one
    admission, and the batcher, which only receives admitted work, keeps no count of its own. (A
    second count, in parts, refused a split video halfway and left its first parts queued for
    nobody.) What one item holds in memory is the request-memory budget's to bound, not this.

    Invariants: ``0 <= pending <= capacity``; :meth:`admit` takes all ``n`` or none, so a request
    is refused whole, before any of its items is decoded; each admitted item is released once.
    """

    def __init__(self, capacity: int, metrics: Metrics) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._metrics = metrics
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    def fits(self, n: int) -> bool:
        """Could ``n`` more items be admitted now? (No mutation.)"""
        return self._pending + n <= self.capacity

    def admit(self, n: int) -> None:
        """Admit ``n`` items at once, or raise ``Unavailable("overloaded")`` (counted) and admit none."""
        if not self.fits(n):
            self._metrics.reject("overloaded")
            raise Unavailable(
                f"encode queue is full ({self._pending} of {self.capacity} pending, {n} more asked)",
                type="overloaded",
                retry_after=1.0,
            )
        self._pending += n

    def release(self) -> None:
        """One admitted item is done (encoded, failed or cancelled)."""
        assert self._pending > 0, "released more items than were admitted"
        self._pending -= 1


class Charge:
    """Bytes acquired from the request-memory budget for one item's preparation. ``close`` gives
    back what is not kept; a kept part goes back when the object holding it is collected, on
    whatever path (encoded, failed, or its requester gone while it decoded)."""

    def __init__(self, budget: ByteBudget | None, nbytes: int) -> None:
        self._budget = budget
        self._left = nbytes

    def keep_while_alive(self, holder: object, nbytes: int) -> None:
        kept = min(nbytes, self._left)
        if self._budget is not None and kept:
            self._left -= kept
            weakref.finalize(holder, self._budget.release, kept)

    def close(self) -> None:
        if self._budget is not None and self._left:
            self._budget.release(self._left)
        self._left = 0


class MemoryCharge:
    """The request-memory budget (the runtime's, shared with the front doors' bodies) charged with
    what decoding an item holds, before it is decoded: refused at once, 503 ``overloaded``, when
    it does not fit. ``budget`` None: nothing is charged."""

    def __init__(self, budget: ByteBudget | None, metrics: Metrics, *, max_pixels: int) -> None:
        self.budget = budget
        self._metrics = metrics
        self._max_pixels = max_pixels

    @contextmanager
    def pixels(self, data: bytes | Image.Image, index: int) -> Iterator[Charge]:
        """An image's decoded pixels (size from its header: bytes, or ``open_image``'s) for the block,
        and what a batched encoder's image holds until its batch (``PreparedItem.pending``) for as
        long as that lives."""
        if self.budget is None:
            yield Charge(None, 0)
            return
        nbytes = decoded_nbytes(data, max_pixels=self._max_pixels, index=index)
        with self.bytes(nbytes, index, "decoding this image") as charge:
            yield charge

    @contextmanager
    def bytes(self, nbytes: int, index: int, what: str) -> Iterator[Charge]:
        """``nbytes`` for the block (a video's ``VideoPlan.nbytes``: its family's figure); what the
        block keeps (``Charge.keep_while_alive``) outlives it."""
        if self.budget is None:
            yield Charge(None, 0)
            return
        if not self.budget.try_acquire(nbytes):
            self._metrics.reject("memory")
            raise Unavailable(
                f"request memory budget is full: {what} takes {nbytes / 2**20:.1f} MiB; retry later",
                type="overloaded", index=index, retry_after=1.0,
            )
        charge = Charge(self.budget, nbytes)
        try:
            yield charge
        finally:
            charge.close()
