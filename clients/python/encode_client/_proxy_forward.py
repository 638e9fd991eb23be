"""The proxy's forward: a prepared request to vLLM, and its answer back as it arrives.

Three parts, each on its own: ``Forwarder.send`` picks an upstream and fails over to the next when
one refuses the connection (and sends once more, on a new connection, when one closes before any
answer); ``read_head`` reads an answer only as far as telling whether vLLM failed the request
before answering (the first SSE event, ``_vllm_failure.StreamGate``, or a 500's body);
``Forwarder.forward`` ties them together and, where asked, says that vLLM failed the request
instead of relaying the failure, so the app may hand its media off again and send it once more.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import StreamingResponse

from encode_client._lanes import AsyncLanes
from encode_client._proxy_errors import Refused, upstream_refusal
from encode_client._proxy_metrics import ProxyMetrics
from encode_client._upstreams import Upstream, Upstreams
from encode_client._vllm_failure import StreamGate, is_generation_error

__all__ = ["HOP_BY_HOP", "Forwarder", "Head", "HeadBroken", "Release", "read_head"]

log = logging.getLogger("encode_client.proxy")

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
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


async def read_head(answer: httpx.Response) -> Head:
    """Read ``answer`` as far as deciding whether vLLM failed the request: an SSE stream up to the
    event that decides it, a 500 whole; anything else not at all."""
    chunks = answer.aiter_raw()
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        gate, prefix = StreamGate(), b""
        try:
            while gate.holding:
                try:
                    prefix += gate.feed(await chunks.__anext__())
                except StopAsyncIteration:
                    prefix += gate.finish()
                    break
        except httpx.HTTPError as exc:
            raise HeadBroken() from exc
        return Head(prefix, chunks, gate.failed)
    if answer.status_code == 500:
        body = b""
        try:
            while len(body) < _ERROR_BODY_LIMIT:
                try:
                    body += await chunks.__anext__()
                except StopAsyncIteration:
                    return Head(body, _nothing(), is_generation_error(500, body))
        except httpx.HTTPError as exc:  # the forward gives the upstream back and answers 502
            raise HeadBroken() from exc
        return Head(body, chunks)  # too long for vLLM's generic failure: relayed as it comes
    return Head(b"", chunks)


class Forwarder:
    """Sends to the least busy vLLM upstream (``Upstreams``), keeping its outstanding count and the
    upstream metrics; ``timeout`` is only named in a 504's message (the pool enforces it)."""

    def __init__(self, http: AsyncLanes, upstreams: Upstreams, metrics: ProxyMetrics, *, timeout: float) -> None:
        self.http, self.upstreams, self.metrics, self.timeout = http, upstreams, metrics, timeout

    async def forward(
        self, method: str, target: str, headers: dict[str, str], body: bytes, *, retryable: bool = False
    ) -> tuple[StreamingResponse, Release] | None:
        """The answer to relay, and what releases its upstream once relayed. ``retryable``: the
        answer's head is read first, and None is returned (the upstream given back) when vLLM failed
        the request before answering, for the caller to send it again or not."""
        path = target.partition("?")[0]
        upstream, answer = await self.send(method, target, headers, body)
        release = self._releaser(upstream, answer)
        try:
            head = await read_head(answer) if retryable else Head(b"", answer.aiter_raw())
        except HeadBroken:
            await release()
            raise Refused(502, "vLLM's answer broke before it could be read (a stream's first event, a 500's body)",
                          "upstream_unavailable") from None
        if head.failed:
            await release()
            return None
        response_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        relay = _relay(head.prefix, head.rest, path, self.metrics)
        return StreamingResponse(relay, status_code=answer.status_code, headers=response_headers), release

    async def send(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[Upstream, httpx.Response]:
        """The answer's headers from the least busy upstream that takes the connection; one that
        refuses it is marked down and the next is tried."""
        tried: set[str] = set()
        last: Exception | None = None
        may_resend = True  # once per request: a connection that closed before any answer
        while (upstream := self.upstreams.pick(tried)) is not None:
            tried.add(upstream.url)
            self.upstreams.started(upstream)
            self.metrics.outstanding.labels(upstream.url).inc()
            started = time.perf_counter()
            try:
                http = self.http.next() if may_resend else self.http.fresh
                request = http.build_request(method, upstream.url + target, content=body, headers=headers)
                answer = await http.send(request, stream=True)
            except httpx.RemoteProtocolError as exc:
                # The server closed the connection without a byte of answer: an idle kept-alive
                # connection whose close raced its reuse (or a server gone mid-request). Sent again
                # once, on a new connection (``AsyncLanes.fresh``), to the least busy upstream (this
                # one included).
                self._finished(upstream)
                if not may_resend:
                    raise upstream_refusal(exc, upstream.url, self.timeout) from None
                may_resend = False
                tried.discard(upstream.url)
                self.metrics.retries.labels("disconnected").inc()
                log.info("%s %s: %s closed the connection before answering (%r); sent again", method, target,
                         upstream.url, exc)
                continue
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._finished(upstream)
                self.upstreams.failed(upstream)
                self.metrics.upstream_up.labels(upstream.url).set(0)
                last = exc
                if len(tried) < len(self.upstreams.all):
                    self.metrics.retries.labels("connect").inc()
                continue
            except httpx.HTTPError as exc:
                self._finished(upstream)
                raise upstream_refusal(exc, upstream.url, self.timeout) from None
            self.metrics.upstream_seconds.labels(upstream.url).observe(time.perf_counter() - started)
            self.metrics.upstream_up.labels(upstream.url).set(1)
            return upstream, answer
        raise Refused(502, f"vLLM server unreachable: {last!r}", "upstream_unavailable")

    def _finished(self, upstream: Upstream) -> None:
        self.upstreams.finished(upstream)
        self.metrics.outstanding.labels(upstream.url).dec()

    def _releaser(self, upstream: Upstream, answer: httpx.Response) -> Release:
        """Closes ``answer`` and gives its upstream back, once however often it is called."""
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                await answer.aclose()
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
    except httpx.HTTPError as exc:
        metrics.errors.labels("upstream_stream_broken").inc()
        log.warning("%s: the answer from vLLM ended early: %r", path, exc)
        error = {"error": {"message": f"vLLM's answer ended early: {exc!r}", "type": "upstream_unavailable",
                           "param": None, "code": 502}}
        yield b"data: " + json.dumps(error).encode() + b"\n\n"
