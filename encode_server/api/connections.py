"""Connection-level limits for the HTTP front door: what uvicorn does not bound by itself.

uvicorn closes a keep-alive connection that stays idle after a response (``timeout_keep_alive``),
but nothing else: a client that opens a connection and never finishes its headers, or declares a
body and then stops sending it (slowloris), holds a socket, a protocol object and, for the body,
an ASGI task forever. This module wraps uvicorn's own protocol class (httptools or h11, whichever
uvicorn picked) with three guards, the ones nginx and Envoy operators know:

- ``--header-timeout``: from the first byte of a request (or the connection's opening) to the end
  of its headers, at most this many seconds. Past it: ``408`` JSON ``request_timeout``, closed.
- ``--body-timeout``: while a request body is incomplete, at most this many seconds without a
  byte of it (an idle timeout: a slow but moving upload is not cut). Past it: ``408`` (when no
  response has started), closed; the handler sees the client as gone. Time in which *we* stopped
  reading (flow control, the app has not consumed the previous chunk) does not count.
- ``--max-connections``: open HTTP connections. One more is answered ``503`` JSON ``overloaded``
  with ``Retry-After`` and closed at once, so the process never runs out of file descriptors.
- ``--max-header-bytes``: a request's head (request line and headers, to the blank line), counted
  as it arrives, before uvicorn's parser holds any of it (httptools has no limit; h11's is set
  above ours). Past it: ``431`` JSON ``headers_too_large``; what the client still sends is read
  and dropped for ``LINGER_S`` so that it reads the answer rather than a reset, then closed. A
  head is counted from a connection's opening and from the end of a response to a request read
  whole; a head pipelined behind a request still being answered is uvicorn's alone.

Each closed connection is counted in ``connections_closed_total{reason}``; ``http_connections``
is the number open now. ``uvicorn_options(settings, metrics)`` is everything the composition
root passes to ``uvicorn.Config``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from encode_server.config import Settings
from encode_server.metrics import Metrics

__all__ = ["LINGER_S", "ConnectionLimits", "guarded_protocol", "head_end", "uvicorn_options"]

# After a 431, how long what the client still sends is read and dropped before the connection closes
# (closing with unread bytes would reset it, and the client would never read the 431).
LINGER_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_connections: int
    keep_alive_timeout: float
    max_header_bytes: int = 64 * 1024

    @classmethod
    def from_settings(cls, s: Settings) -> ConnectionLimits:
        return cls(s.header_timeout, s.body_timeout, s.max_connections, s.keep_alive_timeout, s.max_header_bytes)


def head_end(data: bytes) -> int:
    """The index just past the blank line that ends a request head in ``data``, or -1."""
    ends = [i + len(mark) for mark in (b"\r\n\r\n", b"\n\n") if (i := data.find(mark)) >= 0]
    return min(ends, default=-1)


def _error(status: int, reason: str, error: dict[str, Any], extra: tuple[str, ...] = ()) -> bytes:
    body = json.dumps(error).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def guarded_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits, metrics: Metrics | None) -> type:
    """A subclass of uvicorn's protocol ``base`` that enforces ``limits``.

    It relies only on what both uvicorn implementations share: ``transport``, ``connections``,
    ``flow.read_paused`` and ``cycle`` (``more_body``, ``response_started``, ``response_complete``).
    """
    header_408 = _error(408, "Request Timeout", {"error": {
        "type": "request_timeout", "index": None,
        "message": f"request headers not complete within {limits.header_timeout:g} s (--header-timeout)",
    }})
    body_408 = _error(408, "Request Timeout", {"error": {
        "type": "request_timeout", "index": None,
        "message": f"no request body bytes for {limits.body_timeout:g} s (--body-timeout)",
    }})
    head_431 = _error(431, "Request Header Fields Too Large", {"error": {
        "type": "headers_too_large", "index": None,
        "message": f"request headers are above the limit of {limits.max_header_bytes} bytes (--max-header-bytes)",
    }})
    over_cap = _error(503, "Service Unavailable", {"error": {
        "type": "overloaded", "index": None,
        "message": f"too many open connections (--max-connections {limits.max_connections})",
    }}, ("retry-after: 1",))
    closed = (
        {r: metrics.connections_closed.labels(reason=r)
         for r in ("header_timeout", "body_timeout", "max_connections", "headers_too_large")}
        if metrics is not None else {}
    )
    gauge = metrics.http_connections if metrics is not None else None

    class GuardedProtocol(base):  # type: ignore[valid-type,misc]
        _guard: asyncio.TimerHandle | None = None
        _guard_phase: str | None = None
        _guard_cycle: Any = None
        _counted = False
        # Bytes of the request head being received (None: none is, a body or a response is under
        # way); the last bytes seen, for a blank line split across two reads; dropping after a 431.
        _head: int | None = 0
        _head_tail = b""
        _dropping = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._reject(over_cap, "max_connections")
                return
            self._counted = True
            if gauge is not None:
                gauge.inc()
            self._arm("headers", limits.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted and gauge is not None:
                gauge.dec()
                self._counted = False
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return
            if self._head is not None and self._head_over(data):
                self._refuse_head()
                return
            super().data_received(data)
            if self.transport is None or self.transport.is_closing():
                self._disarm()
                return
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle is self._guard_cycle or cycle.response_complete:
                # No new request's headers yet: bytes of a request still in its header phase.
                if self._guard_phase != "headers":
                    self._guard_cycle = cycle
                    self._arm("headers", limits.header_timeout)
            elif cycle.more_body and not cycle.response_complete:
                self._arm("body", limits.body_timeout)  # progress: restart the idle clock
            else:
                self._disarm()  # the whole request is in; the request timeout is the app's

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # uvicorn's keep-alive timer takes over until the next byte
            cycle = self._guard_cycle = getattr(self, "cycle", None)
            if cycle is None or not cycle.more_body:  # the request was read whole: a head comes next
                self._head, self._head_tail = 0, b""

        # -- internals ---------------------------------------------------------------------------

        def _head_over(self, data: bytes) -> bool:
            """Count ``data`` into the head; whether the head is now above the limit."""
            assert self._head is not None
            seen = self._head_tail + data
            end = head_end(seen)
            if end >= 0:
                size = self._head + end - len(self._head_tail)
                self._head, self._head_tail = None, b""
                return size > limits.max_header_bytes
            self._head += len(data)
            self._head_tail = seen[-3:]
            return self._head > limits.max_header_bytes

        def _refuse_head(self) -> None:
            """431, then read and drop what the client still sends for ``LINGER_S``, then close."""
            self._disarm()
            self._dropping = True
            if "headers_too_large" in closed:
                closed["headers_too_large"].inc()
            self.transport.write(head_431)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

        def _arm(self, phase: str, seconds: float) -> None:
            if self._guard is not None:
                self._guard.cancel()
            self._guard_phase = phase
            self._guard = asyncio.get_running_loop().call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._guard is not None:
                self._guard.cancel()
            self._guard = None
            self._guard_phase = None

        def _expired(self) -> None:
            self._guard = None
            phase, self._guard_phase = self._guard_phase, None
            if self.transport is None or self.transport.is_closing():
                return
            cycle = getattr(self, "cycle", None)
            if phase == "body":
                if cycle is None or not cycle.more_body or cycle.response_complete:
                    return
                flow = getattr(self, "flow", None)
                if flow is not None and flow.read_paused:  # we stopped reading, not the client
                    self._arm("body", limits.body_timeout)
                    return
                self._reject(b"" if cycle.response_started else body_408, "body_timeout")
            elif phase == "headers":
                if cycle is not None and cycle is not self._guard_cycle and not cycle.response_complete:
                    return  # headers arrived meanwhile
                self._reject(header_408, "header_timeout")

        def _reject(self, response: bytes, reason: str) -> None:
            if response:
                self.transport.write(response)
            if reason in closed:
                closed[reason].inc()
            self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def uvicorn_options(settings: Settings, metrics: Metrics | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: the guarded protocol and the keep-alive timeout."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    limits = ConnectionLimits.from_settings(settings)
    return {
        "http": guarded_protocol(AutoHTTPProtocol, limits, metrics),
        # h11 (where httptools is not installed) buffers a head up to its own limit (16 KiB by
        # default): above ours, so that the guard's 431 speaks, not h11's 400.
        "h11_max_incomplete_event_size": limits.max_header_bytes + 1024,
        "timeout_keep_alive": limits.keep_alive_timeout,
        # A connection past the cap is refused by the guard with our JSON 503; uvicorn's own
        # backlog bounds connections not yet accepted.
        "backlog": min(2048, max(128, settings.max_connections)),
    }
