"""The protocol a shared cache tier implements (Redis in production).

The local tier is synchronous and lives on the event loop (``LocalTier``); a shared tier is
remote, so every call is async and batched over many keys: one round trip per request, never
one per item.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from encode_server.core.hashing import CacheKey
from encode_server.core.types import Embedding

__all__ = ["SharedTier"]


class SharedTier(Protocol):
    name: str

    async def get_many(self, keys: Sequence[CacheKey]) -> list[Embedding | None]:
        """Values for ``keys``, in order; None for a miss or an unusable value. Never raises for
        a tier fault: a fault is a miss (the tier is an accelerator, not a dependency)."""
        ...

    async def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Presence of each key, in order; False for a fault, like ``get_many``."""
        ...

    def put_behind(self, key: CacheKey, value: Embedding) -> None:
        """Write after the response; never blocks the caller and never raises for a fault (a
        write that cannot happen is dropped and counted)."""
        ...

    async def put_now(self, entries: Sequence[tuple[CacheKey, Embedding]]) -> None:
        """Write all ``entries`` (one round trip) before returning: the metadata hand-off needs
        the values in the store. Raises a domain error (``Unavailable``, ``TooLarge``, with
        ``index`` = position in ``entries``) when they cannot be stored."""
        ...

    async def start(self) -> None:
        """Start background work (the write-behind queue); called once on the event loop."""
        ...

    async def close(self) -> None: ...
