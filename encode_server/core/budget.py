"""One budget for the request bytes a server holds in memory at once, across both front doors.

``--max-queue`` counts images and applies once a body has been read; nothing else bounds the
bytes of all requests in flight together, so a burst of large uploads can take a replica's memory
(and every request on it) down. Each front door charges what it holds here before holding it
(bodies as they arrive, decoded base64, multipart parts, decoded pixels), and refuses the request
when the charge does not fit: refusing some requests beats losing the process.

The API splits "can I?" (:meth:`ByteBudget.fits`, no mutation) from "do it"
(:meth:`ByteBudget.try_acquire`, all or nothing). Most callers hold a :class:`Hold`: the bytes
of one request, grown as it holds more, settled to what it still holds, released once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ByteBudget", "Hold", "OverBudget"]


class OverBudget(Exception):
    """A charge did not fit; ``asked`` bytes were wanted and ``available`` were left."""

    def __init__(self, asked: int, available: int, capacity: int | None) -> None:
        super().__init__(f"{asked} bytes asked, {available} of {capacity} free")
        self.asked, self.available, self.capacity = asked, available, capacity


class ByteBudget:
    """Bytes held at once, bounded by ``capacity`` (None: unbounded, counted all the same).

    Invariants, checked by :meth:`check_invariants` (the tests call it after every operation):

    (a) ``0 <= used``, and ``used <= capacity`` when there is one: a charge that does not fit
        changes nothing (all or nothing), so the budget is never overdrawn;
    (b) ``used`` is the sum of what was acquired and not yet released: releasing more than is
        held is an error, never a silent clamp to zero;
    (c) ``peak`` is the most ``used`` has been since the budget was made (for reports);
    (d) ``acquired_total`` (bytes ever acquired) never decreases: a change says requests came.

    A charge larger than the whole capacity never fits, even when nothing else is held: the
    caller turns that into "too large" rather than "try again later" (see :meth:`could_ever_fit`).

    Thread-safe: the event loop charges bodies while preprocessing threads charge pixels.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"capacity must be a non-negative int or None, got {capacity!r}")
        self._capacity = capacity
        self._used = 0
        self._peak = 0
        self._acquired_total = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def acquired_total(self) -> int:
        return self._acquired_total

    @property
    def available(self) -> int | None:
        return None if self._capacity is None else self._capacity - self._used

    def could_ever_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit into an empty budget."""
        return self._capacity is None or nbytes <= self._capacity

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit now (no mutation; racy across threads by nature)."""
        _check_size(nbytes)
        return self._capacity is None or self._used + nbytes <= self._capacity

    def try_acquire(self, nbytes: int) -> bool:
        """Charge ``nbytes`` if they fit, all or nothing; False (nothing charged) if not."""
        _check_size(nbytes)
        with self._lock:
            if self._capacity is not None and self._used + nbytes > self._capacity:
                return False
            self._used += nbytes
            self._acquired_total += nbytes
            self._peak = max(self._peak, self._used)
            return True

    def acquire(self, nbytes: int) -> None:
        """:meth:`try_acquire`, raising :class:`OverBudget` when the charge does not fit."""
        if not self.try_acquire(nbytes):
            raise OverBudget(nbytes, self.available or 0, self._capacity)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` acquired earlier; more than is held is a bug (invariant b)."""
        _check_size(nbytes)
        with self._lock:
            if nbytes > self._used:
                raise ValueError(f"release of {nbytes} bytes with only {self._used} held")
            self._used -= nbytes

    def hold(self) -> Hold:
        """A new, empty hold for the bytes of one request."""
        return Hold(self)

    @contextmanager
    def charged(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` for the block (raises :class:`OverBudget` at entry when they don't fit)."""
        self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)

    def check_invariants(self) -> None:
        assert self._used >= 0, self._used
        assert self._capacity is None or self._used <= self._capacity, (self._used, self._capacity)
        assert self._peak >= self._used, (self._peak, self._used)
        assert self._acquired_total >= self._peak, (self._acquired_total, self._peak)


class Hold:
    """The bytes one request holds against a :class:`ByteBudget`.

    Invariants: ``0 <= held``; everything held is in the budget's ``used``; after
    :meth:`release` (idempotent, so every exit path may call it) the hold is closed: it holds
    nothing and any further :meth:`grow` is refused (a late charge after the request ended would
    leak). Thread-safe: a request's parse step may still be charging in a worker thread when the
    event loop releases the hold (the client went away).
    """

    __slots__ = ("_budget", "_closed", "_held", "_lock")

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self._held = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def budget(self) -> ByteBudget:
        return self._budget

    def grow(self, nbytes: int) -> bool:
        """Hold ``nbytes`` more if they fit (False, nothing changed, if not or if closed)."""
        with self._lock:
            if self._closed or not self._budget.try_acquire(nbytes):
                return False
            self._held += nbytes
            return True

    def grow_or_raise(self, nbytes: int) -> None:
        """:meth:`grow`, raising :class:`OverBudget` when it is refused."""
        if not self.grow(nbytes):
            raise OverBudget(nbytes, self._budget.available or 0, self._budget.capacity)

    def shrink(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what this hold has (no more than it has)."""
        with self._lock:
            if nbytes > self._held:
                raise ValueError(f"shrink by {nbytes} bytes with only {self._held} held")
            self._budget.release(nbytes)
            self._held -= nbytes

    def settle(self, nbytes: int) -> bool:
        """Hold exactly ``nbytes`` from now on: what the request still holds once a step has freed
        (or made) copies. Shrinking always succeeds; growing may be refused (False)."""
        _check_size(nbytes)
        with self._lock:
            held = self._held
        if nbytes <= held:
            self.shrink(held - nbytes)
            return True
        return self.grow(nbytes - held)

    @contextmanager
    def transient(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` more for the block only: a copy that lives while a step runs."""
        self.grow_or_raise(nbytes)
        try:
            yield
        finally:
            with self._lock:
                if not self._closed:
                    given = min(nbytes, self._held)  # a settle inside the block may have given it back
                    self._budget.release(given)
                    self._held -= given

    def release(self) -> None:
        """Give back everything and close; a second call does nothing."""
        with self._lock:
            if not self._closed:
                self._closed = True
                held, self._held = self._held, 0
                self._budget.release(held)


def _check_size(nbytes: int) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"a byte count is a non-negative int, got {nbytes!r}")
