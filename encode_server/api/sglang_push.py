"""Where SGLang's embeddings go, and how: the receive URLs its scheduler ranks register, and ZMQ PUSH.

``zmq_to_scheduler`` (SGLang's default): every tensor-parallel rank of the prefill binds a PULL socket
and registers it for each part, ``POST /scheduler_receive_url {req_id, receive_url: "host:port",
receive_count}``, before or after the part's ``/encode`` reaches us. :class:`Registrations` holds
them per part id: ``/encode`` delivers to each URL as it becomes known until ``receive_count``
distinct URLs have had the part. A registration whose ``/encode`` never comes is dropped after
:data:`REGISTRATION_TTL_S` (SGLang's own encoder waits as long).

``zmq_to_tokenizer``: ``/encode`` names one PULL socket (``prefill_host``, ``embedding_port``), bound
for this request alone: a socket of its own, closed (with a linger, so the message still leaves)
once sent. A rank's socket serves every request of that rank, so its PUSH socket is kept, one per
URL (:class:`Pusher`), sends to it serialised by a lock as SGLang's encoder does.

A send waits for the peer to be connected (``ZMQ_IMMEDIATE``: never queued for a peer that is not
there) and fails after ``timeout`` seconds; a socket that failed is closed and made anew next time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

__all__ = ["MAX_PARTS", "REGISTRATION_TTL_S", "DeliveryFailed", "Full", "Pusher", "Registrations", "endpoint_of"]

REGISTRATION_TTL_S = 180.0
# PUSH sockets kept for scheduler ranks; past this the least recently used is closed.
MAX_CACHED_SOCKETS = 1024
_LINGER_MS = 5000
_SEND_HWM = 16
_RECONNECT_MAX_MS = 5000
MAX_PARTS = 65_536  # parts whose registrations are held at once


class DeliveryFailed(Exception):
    """A message could not be handed to a receiver in time."""


def endpoint_of(host_port: str) -> str:
    """``host:port`` (``[v6]:port`` too), as SGLang registers a receive URL, to a ZMQ TCP endpoint."""
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"receive_url must be host:port, not {host_port!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


@dataclass
class _Part:
    count: int | None = None
    urls: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    touched: float = field(default_factory=time.monotonic)


class Full(Exception):
    """Too many parts hold registrations: 503, retry later."""


class Registrations:
    """The receive URLs registered per part id, whichever of ``/encode`` and the registrations came first.

    Invariants: a part's ``count`` never changes once set (a second ``receive_count`` that differs
    is refused, as SGLang's encoder refuses it); its URLs are distinct, in arrival order; a part is
    forgotten when its ``/encode`` is done with it (:meth:`forget`) or :data:`REGISTRATION_TTL_S`
    after it was last touched.
    """

    def __init__(self, ttl: float = REGISTRATION_TTL_S) -> None:
        self.ttl = ttl
        self._parts: dict[str, _Part] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def register(self, req_id: str, url: str, count: int) -> None:
        """Add ``url`` for ``req_id``; ``ValueError`` when ``count`` disagrees with an earlier one, or
        more distinct URLs than it come; ``Full`` past :data:`MAX_PARTS` parts held."""
        self._sweep()
        if req_id not in self._parts and len(self._parts) >= MAX_PARTS:
            raise Full(f"{len(self._parts)} parts already wait for their /encode")
        part = self._parts.setdefault(req_id, _Part())
        if part.count is not None and part.count != count:
            raise ValueError(f"Inconsistent receive_count for req_id={req_id}: registered {part.count}, got {count}")
        if url not in part.urls and len(part.urls) >= count:
            raise ValueError(f"req_id={req_id} already has its {count} receive URLs")
        part.count = count
        part.touched = time.monotonic()
        if url not in part.urls:
            part.urls.append(url)
            part.changed.set()

    def current(self, req_id: str) -> tuple[list[str], int | None]:
        """The URLs registered for ``req_id`` so far and the count expected (None: no registration
        yet). Marks them seen: :meth:`wait` returns early only for a URL registered after this."""
        self._sweep()
        part = self._parts.setdefault(req_id, _Part())
        part.touched = time.monotonic()
        part.changed.clear()
        return list(part.urls), part.count

    async def wait(self, req_id: str, timeout: float) -> None:
        """Until a URL is registered for ``req_id`` after the last :meth:`current`, or ``timeout`` s."""
        part = self._parts.setdefault(req_id, _Part())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(part.changed.wait(), timeout)

    def forget(self, req_id: str) -> None:
        self._parts.pop(req_id, None)

    def _sweep(self) -> None:
        cutoff = time.monotonic() - self.ttl
        for stale in [k for k, p in self._parts.items() if p.touched < cutoff]:
            del self._parts[stale]


class Pusher:
    """ZMQ PUSH sockets to SGLang's receivers: one kept per scheduler rank's URL, one per tokenizer request."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.context = zmq.asyncio.Context()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.IPV6, 1)  # a rank's [v6]:port (endpoint_of brackets it)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)  # embeddings queued for a slow rank: few, not libzmq's 1,000
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)  # a gone rank: back off, not every 100 ms
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:  # a receive URL libzmq cannot parse or resolve
            sock.close(linger=0)
            raise DeliveryFailed(f"cannot connect to {endpoint}: {exc}") from None
        return sock

    async def send_kept(self, endpoint: str, frames: Sequence[bytes | memoryview]) -> None:
        """Send on the socket kept for ``endpoint`` (a scheduler rank's), made on first use."""
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            sock = self._sockets.get(endpoint)
            if sock is None:
                sock = self._sockets[endpoint] = self._socket(endpoint)
                while len(self._sockets) > MAX_CACHED_SOCKETS:
                    old_endpoint, old = self._sockets.popitem(last=False)
                    self._locks.pop(old_endpoint, None)
                    old.close()
            self._sockets.move_to_end(endpoint)
            try:
                await self._send(sock, endpoint, frames)
            except DeliveryFailed:
                if self._sockets.get(endpoint) is sock:
                    del self._sockets[endpoint]
                    self._locks.pop(endpoint, None)
                sock.close(linger=0)
                raise

    async def send_once(self, endpoint: str, frames: Sequence[bytes | memoryview]) -> None:
        """Send on a socket of its own (a tokenizer's per-request port), closed once the message is handed over."""
        sock = self._socket(endpoint)
        try:
            await self._send(sock, endpoint, frames)
        except DeliveryFailed:
            sock.close(linger=0)
            raise
        sock.close()  # the linger lets the message leave

    async def _send(self, sock: zmq.asyncio.Socket, endpoint: str, frames: Sequence[bytes | memoryview]) -> None:
        try:
            await asyncio.wait_for(sock.send_multipart(frames, copy=False), self.timeout)
        except asyncio.TimeoutError:
            raise DeliveryFailed(f"no receiver took the message at {endpoint} within {self.timeout:g} s") from None
        except zmq.ZMQError as exc:
            raise DeliveryFailed(f"sending to {endpoint} failed: {exc}") from None

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self.context.destroy(linger=0)
