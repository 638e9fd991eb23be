"""An LRU cache bounded in bytes, with pinning: the local cache tier (docs/cache.md).

Modelled on vLLM's ``EncoderCacheManager``: entries in use by an in-flight request are pinned by
reference count and never evicted, and the API splits "can I?" (no mutation) from "do it"
(mutation with checked preconditions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["ByteLRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entry(Generic[V]):
    __slots__ = ("pins", "size", "value")

    def __init__(self, value: V, size: int) -> None:
        self.value = value
        self.size = size
        self.pins = 0


class ByteLRU(Generic[K, V]):
    """Least-recently-used cache whose budget is bytes, not entries; pinned entries stay put.

    Invariants, checked by :meth:`check_invariants` (the tests call it after every operation):

    (a) ``used_bytes == sum of entry sizes <= capacity_bytes``, always;
    (b) an entry with pin count > 0 is never evicted (nor removed);
    (c) pin counts never go negative: ``unpin`` of an unpinned key is an error, not a no-op;
    (d) an item larger than what eviction could free is never inserted, and a refused ``put``
        changes nothing (no entry is evicted for an insert that then fails); the caller serves
        such an item uncached. In particular, an item larger than the whole capacity never fits.

    ``capacity_bytes == 0`` turns caching off: every ``put`` returns False.

    Keys are content-addressed in this service (same key, same value), so ``put`` of a present
    key keeps the stored value and only refreshes its recency. ``None`` is not a valid value:
    :meth:`get` returns ``None`` for "absent".

    Not thread-safe, by design: it is used from the asyncio event loop only, where no other
    coroutine runs between a check (``can_fit``) and the action that follows it (``put``).
    """

    def __init__(self, capacity_bytes: int, *, on_evict: Callable[[K, int], None] | None = None) -> None:
        """``on_evict(key, size)`` is called for each entry evicted to make room (for metrics);
        it is called after the cache is consistent again, and not for :meth:`remove`."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()  # least recently used first
        self._used = 0
        self._pinned = 0
        self._evictions = 0

    # -- state -----------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def pinned_bytes(self) -> int:
        """Bytes held by pinned entries: what eviction cannot free."""
        return self._pinned

    @property
    def evictions(self) -> int:
        """Entries evicted to make room since creation (explicit ``remove`` not counted)."""
        return self._evictions

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[K]:
        """Keys from least to most recently used (the eviction order, pinned ones aside)."""
        return list(self._entries)

    def pin_count(self, key: K) -> int:
        """How many holders have pinned ``key``; 0 when absent."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.pins

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: K) -> V | None:
        """The value, marked most recently used; ``None`` when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.value

    def peek(self, key: K) -> V | None:
        """The value without touching recency; ``None`` when absent."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def get_and_pin(self, key: K) -> V | None:
        """:meth:`get`, and pin the entry when present; the caller must :meth:`unpin` it later."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._pin_entry(entry)
        return entry.value

    # -- can I? ----------------------------------------------------------------------------------

    def can_fit(self, size: int) -> bool:
        """Whether an item of ``size`` bytes would fit after evicting every unpinned entry.

        No mutation. False when caching is off, and for anything larger than the capacity.
        """
        _check_size(size)
        return self._capacity > 0 and self._pinned + size <= self._capacity

    # -- do it -----------------------------------------------------------------------------------

    def put(self, key: K, value: V, size: int) -> bool:
        """Insert ``key`` as most recently used, evicting least recently used unpinned entries.

        Returns False and changes nothing when it cannot fit (see :meth:`can_fit`). A present key
        is only refreshed (value and size kept) and returns True.
        """
        _check_size(size)
        if value is None:
            raise ValueError("None cannot be cached: get() uses None for absent")
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if not self.can_fit(size):
            return False
        evicted: list[tuple[K, int]] = []
        to_free = self._used + size - self._capacity
        if to_free > 0:  # choose victims first: an OrderedDict cannot shrink while iterated
            for old_key, entry in self._entries.items():
                if not entry.pins:
                    evicted.append((old_key, entry.size))
                    to_free -= entry.size
                    if to_free <= 0:
                        break
        for old_key, old_size in evicted:
            del self._entries[old_key]
            self._used -= old_size
        self._evictions += len(evicted)
        self._entries[key] = _Entry(value, size)
        self._used += size
        if self._on_evict is not None:
            for old_key, old_size in evicted:
                self._on_evict(old_key, old_size)
        return True

    def pin(self, key: K) -> None:
        """Add one holder to ``key`` so it cannot be evicted. Precondition: ``key`` is present."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"cannot pin {key!r}: not in the cache")
        self._pin_entry(entry)

    def unpin(self, key: K) -> None:
        """Release one holder of ``key``. Precondition: ``key`` is present and pinned."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"cannot unpin {key!r}: not in the cache")
        if entry.pins == 0:
            raise ValueError(f"cannot unpin {key!r}: it is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._pinned -= entry.size

    def remove(self, key: K) -> bool:
        """Drop an unpinned entry. Returns False (and changes nothing) when absent or pinned."""
        entry = self._entries.get(key)
        if entry is None or entry.pins:
            return False
        del self._entries[key]
        self._used -= entry.size
        return True

    def _pin_entry(self, entry: _Entry[V]) -> None:
        if entry.pins == 0:
            self._pinned += entry.size
        entry.pins += 1

    # -- invariants ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (works under ``python -O``)."""
        sizes = [e.size for e in self._entries.values()]
        if self._used != sum(sizes):
            raise AssertionError(f"used_bytes {self._used} != sum of entry sizes {sum(sizes)}")
        if self._used > self._capacity:
            raise AssertionError(f"used_bytes {self._used} > capacity_bytes {self._capacity}")
        if any(e.pins < 0 for e in self._entries.values()):
            raise AssertionError("a pin count is negative")
        pinned = sum(e.size for e in self._entries.values() if e.pins > 0)
        if self._pinned != pinned:
            raise AssertionError(f"pinned_bytes {self._pinned} != sum of pinned entry sizes {pinned}")
        if any(s < 0 or s > self._capacity for s in sizes):
            raise AssertionError("an entry size is negative or larger than the capacity")


def _check_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
