"""The proxy's hand-off memo: what encode-server answered for an item it was handed, kept a short
while, so that the same bytes sent again (a popular image, a conversation re-sending its image)
are rewritten without a round trip to encode-server.

Why it is safe: the key is the item's hash, computed by the proxy from the bytes it received, with
its modality and processor settings, in a client that speaks for one caller's key (so one tenant's
memo never answers another's); the entry is encode-server's own answer for those bytes. What it
skips is only the check that the embedding is still stored. If it is not (evicted, expired, Redis
flushed), the consumer's connector asks encode-server for it by hash, and failing that fails the
request before answering, which the proxy sends again (``--retries``) after handing its media off
for real: a retry never reads the memo (``fresh_handoffs``). So the proxy keeps a memo only with
``--retries`` at least 1, and each entry for ``seconds`` (a minute by default, against the shared
tier's day).

Measured (``bench.epd_system``, 2 cores): see docs/benchmarks.md, "The hand-off memo".
"""

from __future__ import annotations

import contextvars
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from encode_client._base import Flow
from encode_client._client import AsyncClient
from encode_client._images import ImageInput, media, mm_hash
from encode_client._types import Result

__all__ = ["HandoffMemo", "MemoClient", "fresh_handoffs"]

Key = tuple[str, str, str]  # (modality, hash, settings as canonical JSON)

_FRESH: contextvars.ContextVar[bool] = contextvars.ContextVar("encode_client_fresh_handoffs", default=False)


@contextmanager
def fresh_handoffs(fresh: bool = True) -> Iterator[None]:
    """Within this block (this task and the tasks it starts), hand-offs skip the memo: every item
    goes to encode-server, and its answer replaces what the memo held."""
    token = _FRESH.set(fresh)
    try:
        yield
    finally:
        _FRESH.reset(token)


class HandoffMemo:
    """At most ``entries`` answers, each for ``seconds``, least recently used first out."""

    def __init__(self, entries: int, seconds: float, *, on_hit: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if entries < 1 or seconds <= 0:
            raise ValueError("a hand-off memo needs entries >= 1 and seconds > 0")
        self.entries, self.seconds, self._on_hit, self._clock = entries, seconds, on_hit, clock
        self._items: OrderedDict[Key, tuple[float, Result]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Key) -> Result | None:
        held = self._items.get(key)
        if held is None:
            return None
        expires, result = held
        if self._clock() >= expires:
            del self._items[key]
            return None
        self._items.move_to_end(key)
        self._on_hit()
        return result

    def put(self, key: Key, result: Result) -> None:
        self._items[key] = (self._clock() + self.seconds, result)
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)


def memo_key(modality: str, digest: str, settings: Mapping[str, Any] | None) -> Key:
    return modality, digest, json.dumps(dict(settings or {}), sort_keys=True)


class MemoClient(AsyncClient):
    """An ``AsyncClient`` whose hand-offs (``op="handoff"``) answer from ``memo`` the items it holds,
    send the others to encode-server, and remember every answer that carries an embedding's place
    (a hit or an encode; a miss is never kept). Every other call is ``AsyncClient``'s."""

    def __init__(self, urls: str | Sequence[str], *, memo: HandoffMemo, **options: Any) -> None:
        super().__init__(urls, **options)
        self.memo = memo

    def _encode_flow(
        self,
        images: Sequence[ImageInput],
        op: str = "encode",
        modality: str | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> Flow[list[Result]]:
        if op != "handoff":
            return (yield from super()._encode_flow(images, op, modality, settings))
        inputs = [media(i, modality) for i in images]
        keys = [memo_key(m.modality, mm_hash(m.data), settings) for m in inputs]
        fresh = _FRESH.get()
        known = {k: r for k in dict.fromkeys(keys) if not fresh and (r := self.memo.get(k)) is not None}
        todo = [i for i, k in enumerate(keys) if k not in known]
        answered = (yield from super()._encode_flow([images[i] for i in todo], op, modality, settings)) if todo else []
        for i, result in zip(todo, answered, strict=True):
            if result.status in ("hit", "encoded"):
                self.memo.put(keys[i], result)
            known.setdefault(keys[i], result)
        return [replace(known[k], index=index) for index, k in enumerate(keys)]
