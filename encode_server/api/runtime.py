"""What a running server holds, shared by the HTTP and gRPC front doors: settings, metrics, the
service once loaded, the drain state, and the API keys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from encode_server.auth import ApiKeys
from encode_server.config import Settings
from encode_server.core.budget import ByteBudget
from encode_server.core.errors import Unauthorized, Unavailable
from encode_server.metrics import Metrics
from encode_server.service import EncodeService

__all__ = ["Runtime", "shutting_down"]


@dataclass
class Runtime:
    """What a running server holds. ``service`` is None until the model is loaded and warm.

    ``draining`` is set once, on SIGTERM: from then on ``/ready`` is 503 and no new work is
    admitted, while the requests already in flight (``inflight``) run to completion.
    ``stopping`` is set by :meth:`stop_now` (a second SIGTERM, or SIGINT): the requests in flight
    are cancelled, and each door answers its cancelled request with :func:`shutting_down`.
    """

    settings: Settings
    metrics: Metrics
    service: EncodeService | None = None
    draining: bool = False
    stopping: bool = False
    load_error: BaseException | None = None
    inflight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _requests: set[asyncio.Task[object]] = field(default_factory=set, repr=False)  # what stop_now cancels
    keys: ApiKeys | None = field(init=False, repr=False)
    budget: ByteBudget = field(init=False, repr=False)  # request bytes in flight, both doors

    def __post_init__(self) -> None:
        self._idle.set()
        self.keys = ApiKeys.from_settings(self.settings)
        self.budget = ByteBudget(self.settings.max_inflight_bytes)
        self.metrics.watch_budget(self.budget)

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's tenant (None: no keys configured, or a key without one), for HTTP and gRPC
        alike; ``Unauthorized`` (counted) for a missing or wrong key."""
        if self.keys is None:
            return None
        try:
            return self.keys.authenticate(authorization)
        except Unauthorized:
            self.metrics.reject("unauthorized")
            raise

    def cache_tenant(self, tenant: str | None) -> str | None:
        """The tenant that goes into cache keys: the caller's with --tenant-isolation, else none."""
        return tenant if self.settings.tenant_isolation else None

    @property
    def ready(self) -> bool:
        return self.service is not None and not self.draining

    def require_service(self) -> EncodeService:
        if self.service is None or self.draining:
            self.metrics.reject("not_ready")
            if self.stopping:
                raise shutting_down()
            reason = "server is draining" if self.draining else "model is loading"
            raise Unavailable(reason, type="not_ready", retry_after=5.0)
        return self.service

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count one request in flight for as long as the block runs, and hold its task for
        :meth:`stop_now` to cancel."""
        task = asyncio.current_task()
        self.inflight += 1
        self._idle.clear()
        if task is not None:
            self._requests.add(task)
        try:
            yield
        finally:
            if task is not None:
                self._requests.discard(task)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    def stop_now(self) -> int:
        """Admit nothing more and cancel every request in flight; how many were. A door that
        catches the cancellation while ``stopping`` answers ``shutting_down()``, a clean 503."""
        self.draining = self.stopping = True
        for task in self._requests:
            task.cancel()
        return len(self._requests)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, then wait up to ``timeout`` s for in-flight requests; True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def shutting_down() -> Unavailable:
    """What a request in flight when the server stops at once is answered: 503 ``not_ready``, so a
    client retries it elsewhere as it would during a drain."""
    return Unavailable("server is shutting down", type="not_ready", retry_after=5.0)
