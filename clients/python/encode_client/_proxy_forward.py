"""The proxy's forward: a prepared request to vLLM, and its answer back as it arrives.

Three parts, each on its own: ``Forwarder.send`` picks an upstream and fails over to the next when
one refuses the connection (and sends once more, on a new connection, when one closes before any
answer); ``read_head`` reads an answer only as far as telling whether vLLM failed the request
before answering (the first SSE event, ``_vllm_failure.StreamGate``, or a 500's body);
``Forwarder.forward`` ties them together and, where asked, says that vLLM failed the request
instead of relaying the failure, so the app may hand its media off again and send it once more.

The client is aiohttp, over keep-alive connections it pools: per streamed request it costs a
seventh of httpx's CPU (``bench/proxy_clients.py``: 0.34 ms against 2.4 for a 16-token stream),
and vLLM's bytes are relayed as they come, never parsed past a stream's first deciding event.
``--max-connections`` is a semaphore of the forwarder's own, so that waiting for a free
connection (503 ``overloaded_error``) is told apart from a slow connect (the next upstream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from starlette.responses import StreamingResponse

from encode_client._proxy_errors import NoConnectionFree, Refused, upstream_refusal
from encode_client._proxy_metrics import ProxyMetrics
from encode_client._upstreams import Upstream, Upstreams
from encode_client._vllm_failure import StreamGate, is_generation_error

__all__ = ["HOP_BY_HOP", "UPSTREAM_ERRORS", "Forwarder", "Head", "HeadBroken", "Release", "read_head"]

log = logging.getLogger("encode_client.proxy")

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
# What reading vLLM's answer may raise: the connection broke, or it was silent for --timeout
UPSTREAM_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError, asyncio.TimeoutError)
_ERROR_BODY_LIMIT = 1 << 20  # a non-streamed 500 read to tell vLLM's generic failure
Release = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Head:
    """An answer's start: the bytes read (``prefix``, sent first), the rest, and whether vLLM failed
    the request before answering (so it may be sent again)."""

    prefix: bytes
    rest: AsyncIterator[bytes]
    failed: bool = False


class HeadBroken(Exception):
    """vLLM's answer broke before its head was read (a stream's first event, a 500's body)."""


async def read_head(status: int, content_type: str, chunks: AsyncIterator[bytes]) -> Head:
    """Read an answer (its ``status``, ``content_type`` and body ``chunks``) as far as deciding
    whether vLLM failed the request: an SSE stream up to the event that decides it, a 500 whole;
    anything else not at all."""
    if content_type.startswith("text/event-stream"):
        gate, prefix = StreamGate(), b""
        try:
            while gate.holding:
                try:
                    prefix += gate.feed(await chunks.__anext__())
                except StopAsyncIteration:
                    prefix += gate.finish()
                    break
        except UPSTREAM_ERRORS as exc:
            raise HeadBroken() from exc
        return Head(prefix, chunks, gate.failed)
    if status == 500:
        body = b""
        try:
            while len(body) < _ERROR_BODY_LIMIT:
                try:
                    body += await chunks.__anext__()
                except StopAsyncIteration:
                    return Head(body, _nothing(), is_generation_error(500, body))
        except UPSTREAM_ERRORS as exc:  # the forward gives the upstream back and answers 502
            raise HeadBroken() from exc
        return Head(body, chunks)  # too long for vLLM's generic failure: relayed as it comes
    return Head(b"", chunks)


class Forwarder:
    """Sends to the least busy vLLM upstream (``Upstreams``), keeping its outstanding count and the
    upstream metrics, over at most ``max_connections`` connections at once: one kept-alive pool,
    an idle connection dropped after ``keepalive`` seconds. ``timeout``: seconds vLLM may take for
    its headers or its next bytes; ``connect_timeout``: for a connection, and for a free one.
    Made and closed inside the event loop (``start``, ``aclose``)."""

    def __init__(
        self, upstreams: Upstreams, metrics: ProxyMetrics, *, timeout: float, connect_timeout: float,
        max_connections: int, keepalive: float,
    ) -> None:
        self.upstreams, self.metrics, self.timeout = upstreams, metrics, timeout
        self.connect_timeout, self.keepalive = connect_timeout, keepalive
        self._free = asyncio.Semaphore(max_connections)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    def _session(self, *, fresh: bool = False) -> aiohttp.ClientSession:
        """The pooled session; ``fresh``: one that keeps no connection, for a request sent again
        after its kept-alive connection closed under it, which must not meet another such one."""
        if fresh:
            if self._fresh is None:
                self._fresh = self._new_session(aiohttp.TCPConnector(limit=0, force_close=True))
            return self._fresh
        if self._pooled is None:
            self._pooled = self._new_session(aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive))
        return self._pooled

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        # The bytes as vLLM sent them (no decompression), so no encoding the caller did not ask for
        # (the caller's own Accept-Encoding is forwarded); no cookies kept between callers.
        return aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar(),
                                     skip_auto_headers=("User-Agent", "Accept-Encoding"))

    async def aclose(self) -> None:
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()

    async def healthy(self, upstream: Upstream, timeout: float) -> bool:
        """Whether ``upstream`` answers its own ``/health`` with a 200 within ``timeout`` seconds."""
        try:
            async with self._session().get(upstream.url + "/health",
                                           timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
                return answer.status == 200
        except UPSTREAM_ERRORS:
            return False

    async def forward(
        self, method: str, target: str, headers: dict[str, str], body: bytes, *, retryable: bool = False
    ) -> tuple[StreamingResponse, Release] | None:
        """The answer to relay, and what releases its upstream once relayed. ``retryable``: the
        answer's head is read first, and None is returned (the upstream given back) when vLLM failed
        the request before answering, for the caller to send it again or not."""
        path = target.partition("?")[0]
        upstream, answer = await self.send(method, target, headers, body)
        release = self._releaser(upstream, answer)
        chunks = answer.content.iter_any().__aiter__()
        try:
            content_type = answer.headers.get("content-type", "")
            head = await read_head(answer.status, content_type, chunks) if retryable else Head(b"", chunks)
        except HeadBroken:
            await release()
            raise Refused(502, "vLLM's answer broke before it could be read (a stream's first event, a 500's body)",
                          "upstream_unavailable") from None
        except BaseException:  # a cut while the head is read: its connection is not the app's yet
            await release()
            raise
        if head.failed:
            await release()
            return None
        response_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        relay = _relay(head.prefix, head.rest, path, self.metrics)
        return StreamingResponse(relay, status_code=answer.status, headers=response_headers), release

    async def send(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """The answer's headers from the least busy upstream that takes the connection; one that
        refuses it is marked down and the next is tried. A connection is held from here until the
        answer is released."""
        if self._free.locked():  # every connection busy: wait for one, as long as for a connect
            try:
                await asyncio.wait_for(self._free.acquire(), self.connect_timeout)
            except TimeoutError:
                raise upstream_refusal(NoConnectionFree(), "", self.timeout) from None
        else:
            await self._free.acquire()
        try:
            return await self._send(method, target, headers, body)
        except BaseException:
            self._free.release()
            raise

    async def _send(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        tried: set[str] = set()
        last: Exception | None = None
        may_resend = True  # once per request: a connection that closed before any answer
        while (upstream := self.upstreams.pick(tried)) is not None:
            tried.add(upstream.url)
            self.upstreams.started(upstream)
            self.metrics.outstanding.labels(upstream.url).inc()
            started = time.perf_counter()
            try:
                session = self._session(fresh=not may_resend)
                answer = await session.request(method, upstream.url + target, data=body, headers=headers)
            except aiohttp.ServerDisconnectedError as exc:
                # The server closed the connection without a byte of answer: an idle kept-alive
                # connection whose close raced its reuse (or a server gone mid-request). Sent again
                # once, on a new connection, to the least busy upstream (this one included).
                self._finished(upstream)
                if not may_resend:
                    raise upstream_refusal(exc, upstream.url, self.timeout) from None
                may_resend = False
                tried.discard(upstream.url)
                self.metrics.retries.labels("disconnected").inc()
                log.info("%s %s: %s closed the connection before answering (%r); sent again", method, target,
                         upstream.url, exc)
                continue
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self._finished(upstream)
                self.upstreams.failed(upstream)
                self.metrics.upstream_up.labels(upstream.url).set(0)
                last = exc
                if len(tried) < len(self.upstreams.all):
                    self.metrics.retries.labels("connect").inc()
                continue
            except UPSTREAM_ERRORS as exc:
                self._finished(upstream)
                raise upstream_refusal(exc, upstream.url, self.timeout) from None
            self.metrics.upstream_seconds.labels(upstream.url).observe(time.perf_counter() - started)
            self.metrics.upstream_up.labels(upstream.url).set(1)
            return upstream, answer
        raise Refused(502, f"vLLM server unreachable: {last!r}", "upstream_unavailable")

    def _finished(self, upstream: Upstream) -> None:
        self.upstreams.finished(upstream)
        self.metrics.outstanding.labels(upstream.url).dec()

    def _releaser(self, upstream: Upstream, answer: aiohttp.ClientResponse) -> Release:
        """Gives ``answer``'s connection back (to the pool when its body was read whole, else
        closed) and its upstream, once however often it is called."""
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                answer.release()
                self._free.release()
                self._finished(upstream)

        return release


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover - makes this an async generator


async def _relay(prefix: bytes, chunks: AsyncIterator[bytes], path: str, metrics: ProxyMetrics) -> AsyncIterator[bytes]:
    """The answer as it arrives; a stream that breaks ends with an SSE error event (the status is
    long sent), anything else is cut (the client sees an incomplete body, not a complete one)."""
    if prefix:
        yield prefix
    try:
        async for chunk in chunks:
            if chunk:
                yield chunk
    except UPSTREAM_ERRORS as exc:
        metrics.errors.labels("upstream_stream_broken").inc()
        log.warning("%s: the answer from vLLM ended early: %r", path, exc)
        error = {"error": {"message": f"vLLM's answer ended early: {exc!r}", "type": "upstream_unavailable",
                           "param": None, "code": 502}}
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
