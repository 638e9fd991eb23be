"""The proxy's vLLM upstreams: which one takes the next request (least outstanding requests).

A pure state machine with an injected clock (no I/O): ``pick`` chooses, ``started`` / ``finished``
count a request's life on an upstream, ``failed`` marks one down after it refused a connection.

Invariants: ``outstanding`` is never negative and is the number of ``started`` without their
``finished``; ``pick`` never returns an upstream in ``exclude``; among the others it prefers one
that is not marked down, then the fewest outstanding requests, ties broken in turn (so equal
upstreams share the load instead of the first taking all); when every upstream is down it still
returns one (a mark is a hint that expires, not a verdict), so a restarted vLLM is found at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Upstream", "Upstreams"]


@dataclass
class Upstream:
    url: str
    outstanding: int = 0
    down_until: float = 0.0


class Upstreams:
    def __init__(self, urls: Sequence[str], *, down_for: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if not urls:
            raise ValueError("at least one vLLM upstream URL is required")
        cleaned = [u.strip().rstrip("/") for u in urls]
        bad = [u for u in cleaned if not u.startswith(("http://", "https://"))]
        if bad or len(set(cleaned)) != len(cleaned):
            raise ValueError(f"vLLM upstreams must be distinct http(s):// URLs, got {list(urls)}")
        self.all = [Upstream(u) for u in cleaned]
        self.down_for = down_for
        self._clock = clock
        self._turn = 0

    def pick(self, exclude: frozenset[str] | set[str] = frozenset()) -> Upstream | None:
        """The upstream for the next request, or None when every one is excluded."""
        now = self._clock()
        n = len(self.all)
        candidates = [(i, u) for i, u in enumerate(self.all) if u.url not in exclude]
        if not candidates:
            return None
        i, chosen = min(candidates, key=lambda c: (c[1].down_until > now, c[1].outstanding, (c[0] - self._turn) % n))
        self._turn = (i + 1) % n
        return chosen

    def started(self, upstream: Upstream) -> None:
        upstream.outstanding += 1

    def finished(self, upstream: Upstream) -> None:
        assert upstream.outstanding > 0, upstream
        upstream.outstanding -= 1

    def failed(self, upstream: Upstream) -> None:
        """``upstream`` refused a connection: prefer the others for ``down_for`` seconds."""
        upstream.down_until = self._clock() + self.down_for

    def up(self, upstream: Upstream) -> bool:
        return upstream.down_until <= self._clock()
