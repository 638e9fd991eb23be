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
        # No connection kept: a request sent again after its kept-alive connection closed under it
        # must not meet another such connection.
        self.fresh = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=per_lane.max_connections, max_keepalive_connections=0), verify=tls)

    def next(self) -> httpx.AsyncClient:
        """The pool for the next request."""
        return next(self._turn)

    async def aclose(self) -> None:
        for client in [*self.clients, self.fresh]:
            await client.aclose()
