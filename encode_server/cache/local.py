"""The in-process tier: a byte-bounded LRU of embeddings, with pins held by in-flight requests."""

from __future__ import annotations

from encode_server.core.hashing import CacheKey
from encode_server.core.lru import ByteLRU
from encode_server.core.types import Embedding
from encode_server.metrics import Metrics

__all__ = ["LocalTier"]


class LocalTier:
    """``ByteLRU`` plus the metrics. Event-loop only, like the LRU itself."""

    name = "local"

    def __init__(self, capacity_bytes: int, metrics: Metrics) -> None:
        evictions = metrics.cache_evictions.labels(tier=self.name)
        self._lru: ByteLRU[CacheKey, Embedding] = ByteLRU(
            capacity_bytes, on_evict=lambda _key, _size: evictions.inc()
        )
        self._lookups_hit = metrics.cache_lookups.labels(tier=self.name, result="hit")
        self._lookups_miss = metrics.cache_lookups.labels(tier=self.name, result="miss")
        metrics.cache_bytes.labels(tier=self.name).set_function(lambda: self._lru.used_bytes)
        metrics.cache_entries.labels(tier=self.name).set_function(lambda: len(self._lru))
        metrics.cache_pinned_bytes.labels(tier=self.name).set_function(lambda: self._lru.pinned_bytes)

    @property
    def lru(self) -> ByteLRU[CacheKey, Embedding]:
        return self._lru

    def get_and_pin(self, key: CacheKey) -> Embedding | None:
        """A hit is pinned until ``unpin``; the caller must unpin exactly once."""
        value = self._lru.get_and_pin(key)
        (self._lookups_hit if value is not None else self._lookups_miss).inc()
        return value

    def peek(self, key: CacheKey) -> Embedding | None:
        """The value without touching recency or the lookup counters."""
        return self._lru.peek(key)

    def put(self, key: CacheKey, value: Embedding) -> bool:
        """Cache ``value``; False when it can't fit (larger than the budget, or all pinned)."""
        return self._lru.put(key, value, value.nbytes)

    def put_and_pin(self, key: CacheKey, value: Embedding) -> bool:
        """Cache ``value`` and pin it for the caller; False (nothing pinned) when it can't fit."""
        if not self.put(key, value):
            return False
        self._lru.pin(key)
        return True

    def unpin(self, key: CacheKey) -> None:
        self._lru.unpin(key)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._lru

    def pin_if_present(self, key: CacheKey) -> bool:
        """Pin an entry another coroutine cached; False when it was not cached (too large)."""
        if key not in self._lru:
            return False
        self._lru.pin(key)
        return True
