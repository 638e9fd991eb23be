"""How ``encode-epd-proxy`` stops: ``ProxyServer``, uvicorn with a drain in front of its shutdown
and a cut for what the drain did not finish."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from encode_client._proxy_app import ProxyApp

__all__ = ["CUT_GRACE_S", "ProxyServer"]

log = logging.getLogger("encode_client.proxy")

CUT_GRACE_S = 2.0  # how long the answers a cut sends (error events, 503s) may take to be written
_POLL_S = 0.05


class ProxyServer(uvicorn.Server):
    """uvicorn, stopped as an operator expects of a proxy.

    The first SIGTERM or SIGINT (or ``request_stop()``, from any thread) drains: ``app.draining``
    is set at once, so ``/health`` answers 503 and new requests 503 ``unavailable_error``, while the
    socket stays open for probes and late clients to hear it; the requests in flight, streams too,
    have ``drain_seconds`` to finish; then uvicorn's own shutdown closes the socket and the pools.

    The second signal, or the drain's time up, cuts what is still in flight (``ProxyApp.cut``):
    each stream ends with an error event and ``data: [DONE]``, a request not yet answered gets 503,
    and each is logged as cut. Further signals are ignored: the stop that follows is bounded.
    uvicorn's own signal handling (a force exit on a second SIGINT that leaves tasks to be cancelled,
    with their tracebacks, and the signal raised again once stopped) is not used.
    """

    def __init__(self, config: uvicorn.Config, app: ProxyApp, drain_seconds: float) -> None:
        super().__init__(config)
        self.proxy_app = app
        self.drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stops = 0
        self._drain: asyncio.Task[None] | None = None
        self._cut: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.request_stop(signal.Signals(sig).name)

    def request_stop(self, why: str) -> None:
        """The first call drains, the second cuts; safe from a signal handler and from any thread
        (the work is done on the server's loop)."""
        self.proxy_app.draining = True
        self._stops += 1
        if self._loop is None:  # not serving yet: uvicorn will not start its main loop
            self.should_exit = True
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: stopped already
            self._loop.call_soon_threadsafe(self._on_stop, why, self._stops)

    def _on_stop(self, why: str, nth: int) -> None:
        if nth == 1:
            self._drain = asyncio.ensure_future(self._drain_then_exit(why))
        elif nth == 2 and self._cut is None:  # not already cut by the drain's time running out
            if self._drain is not None:
                self._drain.cancel()
            self._cut = asyncio.ensure_future(self._cut_then_exit(f"{why} again"))
        else:
            log.info("%s: already stopping (what was in flight is cut; the stop takes at most %g s more)", why,
                     CUT_GRACE_S)

    async def _drain_then_exit(self, why: str) -> None:
        requests, streams = self.proxy_app.open_requests()
        log.info(
            "%s: draining: waiting up to %g s (--drain-seconds) for %d request(s) in flight (%d streaming) to "
            "finish; /health answers 503 and new requests 503 unavailable_error meanwhile; a second SIGINT or "
            "SIGTERM cuts them", why, self.drain_seconds, requests, streams,
        )
        started = time.monotonic()
        deadline = started + self.drain_seconds
        while self.proxy_app.open_requests()[0] and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        left, _ = self.proxy_app.open_requests()
        if not left:
            log.info("drained in %.1f s; stopping", time.monotonic() - started)
            self.should_exit = True
            return
        self._cut = asyncio.ensure_future(
            self._cut_then_exit(f"drain time ({self.drain_seconds:g} s, --drain-seconds) is up"))

    async def _cut_then_exit(self, why: str) -> None:
        requests, streams = self.proxy_app.open_requests()
        log.warning("%s: cutting %d request(s) in flight: %d stream(s) end with an error event and [DONE], the rest "
                    "answered 503 unavailable_error; stopping", why, requests, streams)
        self.proxy_app.cut()
        deadline = time.monotonic() + CUT_GRACE_S
        while self.proxy_app.open_requests()[0] and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        self.should_exit = True
