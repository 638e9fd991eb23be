"""Several httpx connection pools used in turn ("lanes"), where one would be shared by many
concurrent requests.

Why: httpcore 1.0's pool re-examines every connection for every waiting request each time one
finishes (``_assign_requests_to_connections``), so its cost grows with the square of its
connections. Measured on loopback, 64 concurrent streaming requests reusing one pool's keep-alive
connections waited 440-630 ms (p50) for their headers, against 70-90 ms without keep-alive; over
16 pools used in turn, 36-54 ms. The pools together hold what ``limits`` allows.
"""

from __future__ import annotations

import itertools
import math

import httpx

__all__ = ["AsyncLanes"]


class AsyncLanes:
    def __init__(self, lanes: int, *, timeout: httpx.Timeout | float, limits: httpx.Limits | None = None) -> None:
        if lanes < 1:
            raise ValueError("lanes must be >= 1")
        limits = limits or httpx.Limits()

        def share(n: int | None) -> int | None:
            return None if n is None else max(1, math.ceil(n / lanes))

        per_lane = httpx.Limits(
            max_connections=share(limits.max_connections),
            max_keepalive_connections=share(limits.max_keepalive_connections),
            keepalive_expiry=limits.keepalive_expiry,
        )
        tls = httpx.create_ssl_context()  # one CA bundle for all lanes (loading it takes ~25 ms each)
        self.clients = [httpx.AsyncClient(timeout=timeout, limits=per_lane, verify=tls) for _ in range(lanes)]
        self._turn = itertools.cycle(self.clients)
        self._timeout, self._max_connections, self._tls = timeout, per_lane.max_connections, tls
        self._fresh: httpx.AsyncClient | None = None

    def next(self) -> httpx.AsyncClient:
        """The pool for the next request."""
        return next(self._turn)

    @property
    def fresh(self) -> httpx.AsyncClient:
        """A client that keeps no connection: for a request sent again after its kept-alive
        connection closed under it, which must not meet another such connection."""
        if self._fresh is None:
            limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=0)
            self._fresh = httpx.AsyncClient(timeout=self._timeout, limits=limits, verify=self._tls)
        return self._fresh

    async def aclose(self) -> None:
        for client in [*self.clients, *([self._fresh] if self._fresh else [])]:
            await client.aclose()
