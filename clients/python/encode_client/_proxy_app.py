"""``ProxyApp``, the ASGI application of ``encode-epd-proxy`` (``encode_client.proxy``): one
request from admission to its answer; the rewrite, the forward and the error table are modules of
their own."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from encode_client._callers import Caller, Callers
from encode_client._client import AsyncClient
from encode_client._proxy_errors import REWRITE_ERRORS, Refused, error_body, openai_error, rewrite_refusal
from encode_client._proxy_forward import HOP_BY_HOP, Forwarder, Release
from encode_client._proxy_head import head_bytes, head_refusal
from encode_client._proxy_metrics import ProxyMetrics
from encode_client._proxy_rewrite import CHAT, Checked, check_body, prepare_body
from encode_client._proxy_settings import ProxySettings
from encode_client._upstreams import Upstreams
from encode_client.epd import EpdContract

__all__ = ["FORWARDED", "OPEN_PATHS", "OWN_ROUTES", "ProxyApp"]

log = logging.getLogger("encode_client.proxy")

# Every route vLLM serves that a client may reach through the proxy. Others (the Responses, pooling,
# tokenizer, render, token-in and admin routes) take content the proxy does not check, such as a
# part with a uuid, so they are refused rather than forwarded.
FORWARDED = frozenset(
    {("POST", CHAT), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/ping"), ("GET", "/version"),
     ("GET", "/load")}
)
OWN_ROUTES = frozenset({("GET", "/health"), ("GET", "/metrics")})  # the proxy's own, never forwarded
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})  # probes: no key needed
# How long an idle upstream connection is kept for reuse: well under the 5 s after which vLLM's and
# encode-server's uvicorn close one (their keep-alive timeout), so the proxy does not send a request
# on a connection the server is closing at that moment (httpx's default, 5 s, is exactly the race).
_KEEPALIVE_S = 2.0


@dataclass(eq=False)
class _Exchange:
    """One request's bookkeeping: what the log line and the metrics say, what to release after,
    and what a cut must still send (``ProxyApp.cut``)."""

    method: str
    path: str
    task: asyncio.Task[Any] | None = None
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    stream: bool = False  # an SSE answer has started
    complete: bool = False  # the answer's last byte is sent
    ending: bytes = b""  # the last bytes sent: a cut stream's error event starts on an event's boundary
    cut: bool = False
    images: int = 0
    videos: int = 0
    audios: int = 0
    tenant: str | None = None
    cleanup: list[Release] = field(default_factory=list)


class ProxyApp:
    """The ASGI application (``encode_client.proxy``'s docstring): admission (routes, keys, drain,
    ``--max-concurrency``, the body's bound), then the rewrite step (``_proxy_rewrite``, handed the
    contract this app reads once) and the forward (``_proxy_forward``), both again while vLLM fails
    the request before answering and ``--retries`` are left; every refusal is a ``Refused``
    (``_proxy_errors``), answered and counted here. ``draining`` turns ``/health`` to 503."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.callers = Callers(settings.api_keys) if settings.api_keys else None
        self.upstreams = Upstreams(settings.vllm_urls, down_for=settings.down_for)
        self.metrics = ProxyMetrics()
        self.draining = False
        self.inflight = 0
        self._open: set[_Exchange] = set()  # every HTTP request being answered, the probes' too
        self._contract: EpdContract | None = None
        self._forwarder: Forwarder | None = None
        self._encoders: dict[str | None, AsyncClient] = {}
        for upstream in self.upstreams.all:
            self.metrics.upstream_up.labels(upstream.url).set(1)
            self.metrics.outstanding.labels(upstream.url).set(0)

    # -- lifespan --------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        pool = httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections,
                            keepalive_expiry=_KEEPALIVE_S)
        self._forwarder = Forwarder(self.upstreams, self.metrics, timeout=s.timeout, connect_timeout=s.connect_timeout,
                                    max_connections=s.max_connections, keepalive=_KEEPALIVE_S)
        keys = [c.key for c in self.callers] if self.callers is not None else [s.api_key]
        self._encoders = {
            k: AsyncClient(list(s.encoder_urls), api_key=k, response="json", timeout=s.encoder_timeout, pool=pool,
                           http="aiohttp")
            for k in keys
        }

    async def shutdown(self) -> None:
        for encoder in self._encoders.values():
            await encoder.aclose()
        if self._forwarder is not None:
            await self._forwarder.aclose()

    def encoder_for(self, caller: Caller | None) -> AsyncClient:
        """The encode-server client that speaks for ``caller`` (with its key, hence its tenant)."""
        return self._encoders[caller.key if caller is not None else next(iter(self._encoders))]

    async def contract(self, caller: Caller | None) -> EpdContract:
        """The served family's EPD contract (its modes and fields), read from encode-server's
        ``GET /v1/model`` by the first request with media and kept; a failed read is retried by the
        next one. The rewrite is handed it, and never reads one of its own."""
        if self._contract is None:
            self._contract = EpdContract.from_model(await self.encoder_for(caller).model())
        return self._contract

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        exchange = _Exchange(scope["method"], scope["path"], asyncio.current_task())

        async def send_status(message: MutableMapping[str, Any]) -> None:
            await send(message)  # uvicorn's send writes all of a message or, cancelled, none of it
            if message["type"] == "http.response.start":
                exchange.status = int(message["status"])
                headers = dict(message.get("headers") or ())
                exchange.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                exchange.ending = body[-2:] if len(body) >= 2 else (exchange.ending + body)[-2:]
                exchange.complete = not message.get("more_body", False)

        self._open.add(exchange)
        try:
            try:
                response = await self._answer(Request(scope, receive), exchange)
                await response(scope, receive, send_status)
            except asyncio.CancelledError:
                if not exchange.cut:
                    raise
                uncancel = getattr(exchange.task, "uncancel", None)  # Python 3.11+: the cut is handled here
                if uncancel is not None:
                    uncancel()
                await self._end_cut(exchange, send_status)
        finally:
            self._open.discard(exchange)
            for release in reversed(exchange.cleanup):
                await release()
            self._record(exchange)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _record(self, exchange: _Exchange) -> None:
        known = (exchange.method, exchange.path) in FORWARDED | OWN_ROUTES
        route = exchange.path if known else "other"
        self.metrics.requests.labels(route, str(exchange.status)).inc()
        self.metrics.request_seconds.labels(route).observe(time.perf_counter() - exchange.started)
        if exchange.path not in OPEN_PATHS or exchange.cut:
            log.info(
                "%s %s %s images=%d videos=%d audios=%d tenant=%s %.1f ms", exchange.method, exchange.path,
                _outcome(exchange), exchange.images, exchange.videos, exchange.audios, exchange.tenant or "-",
                (time.perf_counter() - exchange.started) * 1000,
            )

    def head_refused(self) -> None:
        """A request whose head the connection refused (``_proxy_head``): it never reached the app."""
        self.metrics.errors.labels("invalid_request_error").inc()
        self.metrics.requests.labels("other", "431").inc()

    # -- the stop: cut what is in flight ----------------------------------------------------------

    def open_requests(self) -> tuple[int, int]:
        """The requests being answered now (the probes included), and how many of them stream."""
        live = [e for e in self._open if not e.complete]
        return len(live), sum(e.stream for e in live)

    def cut(self) -> int:
        """Stop every request in flight (``ProxyServer``'s second signal, or its drain's time up):
        each is cancelled where it waits (encode-server, vLLM, the client) and ends as
        ``_end_cut`` says. The number cut."""
        cut = [e for e in self._open if not e.complete and not e.cut and e.task is not None]
        for exchange in cut:
            exchange.cut = True
            assert exchange.task is not None
            exchange.task.cancel()
        return len(cut)

    async def _end_cut(self, exchange: _Exchange, send: Any) -> None:
        """What a cut request is sent last: a stream its error event and ``data: [DONE]`` (the
        status is long sent); a request not yet answered 503 ``unavailable_error``; a JSON answer
        under way nothing more (its connection is closed under it: a client sees a body cut short,
        never a complete one)."""
        message = "the proxy was stopped before this answer was complete; send it again"
        self.metrics.errors.labels("unavailable_error").inc()
        if exchange.status == 0:
            response = openai_error(503, message, "unavailable_error", **{"Retry-After": "1", "Connection": "close"})
            await send({"type": "http.response.start", "status": 503, "headers": response.raw_headers})
            await send({"type": "http.response.body", "body": response.body})
        elif exchange.stream:
            event = b"data: " + json.dumps(error_body(503, message, "unavailable_error")).encode() + b"\n\n"
            boundary = b"" if exchange.ending == b"\n\n" else b"\n\n"
            await send({"type": "http.response.body", "body": boundary + event + b"data: [DONE]\n\n",
                        "more_body": False})

    # -- one request ----------------------------------------------------------------------------

    async def _answer(self, request: Request, exchange: _Exchange) -> Response:
        try:
            return await self._handle(request, exchange)
        except Refused as refused:
            self.metrics.errors.labels(refused.kind).inc()
            return refused.response()
        except Exception:  # a bug here must still be an OpenAI-shaped answer, and logged
            log.exception("%s %s: the proxy failed", request.method, request.url.path)
            self.metrics.errors.labels("internal_error").inc()
            return openai_error(500, "the EPD proxy failed on this request (logged)", "internal_error")

    async def _handle(self, request: Request, exchange: _Exchange) -> Response:
        if (size := head_bytes(request.scope)) > self.settings.max_header_bytes:
            message, kind = head_refusal(self.settings.max_header_bytes, size)
            raise Refused(431, message, kind, Connection="close")
        route = (request.method, request.url.path)
        if route == ("GET", "/health"):
            return await self._health()
        if route == ("GET", "/metrics"):
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        if route not in FORWARDED:
            routes = ", ".join(f"{m} {p}" for m, p in sorted(FORWARDED | OWN_ROUTES))
            raise Refused(404, f"the EPD proxy does not forward {route[0]} {route[1]}; it serves {routes}",
                          "not_found_error")
        caller = None
        if self.callers is not None and request.url.path not in OPEN_PATHS:
            caller = self.callers.authenticate(request.headers.get("authorization"))
            if caller is None:
                raise Refused(401, "missing or unknown API key: send 'Authorization: Bearer KEY'",
                              "authentication_error")
            exchange.tenant = caller.tenant
        if self.draining:
            raise Refused(503, "the proxy is shutting down; retry on another", "unavailable_error",
                          **{"Retry-After": "1", "Connection": "close"})
        if self.inflight >= self.settings.max_concurrency:
            raise Refused(503, f"the proxy is serving {self.inflight} requests, its --max-concurrency; retry",
                          "overloaded_error", **{"Retry-After": "1"})
        self.inflight += 1
        self.metrics.inflight.inc()
        exchange.cleanup.append(self._left)
        body = await self._body(request)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = self._upstream_headers(request)
        checked = None
        if request.method == "POST":
            try:
                checked = check_body(body, request.url.path, trust_client_embeds=self.settings.trust_client_embeds,
                                     trust_request_mm_kwargs=self.settings.trust_request_mm_kwargs)
            except REWRITE_ERRORS as exc:
                raise rewrite_refusal(exc) from None
            body = await self._prepare(checked, caller, exchange)
        for attempt in range(1, self.settings.retries + 2):
            retryable = checked is not None and checked.has_media and attempt <= self.settings.retries
            response = await self._forward(request.method, target, headers, body, exchange, retryable=retryable)
            if response is not None:
                return response
            # vLLM failed it before answering (its EC connector found the embedding nowhere): the
            # media handed off again, under the contract this proxy holds, and sent once more
            self.metrics.retries.labels("prefill_error").inc()
            log.warning("%s %s: vLLM failed the request before answering; media handed off again, retry %d",
                        request.method, request.url.path, attempt)
            assert checked is not None  # only a chat with media is retryable
            body = await self._prepare(checked, caller, exchange)
        raise AssertionError("the last attempt is not retryable: it is answered")  # pragma: no cover

    async def _forward(
        self, method: str, target: str, headers: dict[str, str], body: bytes, exchange: _Exchange,
        *, retryable: bool = False,
    ) -> Response | None:
        """vLLM's answer, its upstream released after it is relayed; None: vLLM failed the request
        before answering (``retryable`` only)."""
        assert self._forwarder is not None  # made at startup
        forwarded = await self._forwarder.forward(method, target, headers, body, retryable=retryable)
        if forwarded is None:
            return None
        response, release = forwarded
        exchange.cleanup.append(release)
        return response

    async def _left(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.dec()

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            status = 413 if declared.isdigit() else 400
            raise Refused(status, f"the body must be at most {limit} bytes (Content-Length {declared!r})",
                          "invalid_request_error")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refused(413, f"the body must be at most {limit} bytes", "invalid_request_error")
                chunks.append(chunk)
        except ClientDisconnect:
            raise Refused(400, "the client went away while sending the body", "invalid_request_error") from None
        return b"".join(chunks)

    async def _prepare(self, checked: Checked, caller: Caller | None, exchange: _Exchange) -> bytes:
        """``checked`` as vLLM gets it, its media handed off (again, for a retry) under the family's
        contract (``contract``), read only for a request with media and passed down."""
        try:
            contract = await self.contract(caller) if checked.has_media else None
            prepared = await prepare_body(checked, encoder=self.encoder_for(caller), contract=contract,
                                          tenant=caller.tenant if caller else None)
        except REWRITE_ERRORS as exc:
            raise rewrite_refusal(exc) from None
        if prepared.handoff_seconds is not None:
            self.metrics.handoff_seconds.observe(prepared.handoff_seconds)
            self.metrics.handoff_images.inc(prepared.images)
            self.metrics.handoff_videos.inc(prepared.videos)
            self.metrics.handoff_audios.inc(prepared.audios)
        exchange.images, exchange.videos, exchange.audios = prepared.images, prepared.videos, prepared.audios
        return prepared.body

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.callers is not None or self.settings.vllm_api_key:  # a caller's key stays here
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        if self.settings.vllm_api_key:
            headers["Authorization"] = f"Bearer {self.settings.vllm_api_key}"
        return headers

    async def _health(self) -> Response:
        if self.draining:
            return openai_error(503, "draining: the proxy is shutting down", "unavailable_error",
                                **{"Retry-After": "1", "Connection": "close"})
        assert self._forwarder is not None
        timeout = min(2.0, self.settings.connect_timeout)
        states = await asyncio.gather(*(self._forwarder.healthy(u, timeout) for u in self.upstreams.all))
        for upstream, up in zip(self.upstreams.all, states, strict=True):
            self.metrics.upstream_up.labels(upstream.url).set(int(up))
        report = {u.url: "up" if up else "down" for u, up in zip(self.upstreams.all, states, strict=True)}
        if not any(states):
            self.metrics.errors.labels("upstream_unavailable").inc()
            return openai_error(502, f"no vLLM upstream answers /health: {report}", "upstream_unavailable")
        return JSONResponse({"status": "ok", "upstreams": report, "inflight": self.inflight})


def _outcome(exchange: _Exchange) -> str:
    """A request's log word: its status, or how a cut ended it."""
    if not exchange.cut:
        return str(exchange.status)
    if exchange.stream:
        return f"cut (stream ended with an error event and [DONE] after {exchange.status})"
    return "cut (answered 503)" if exchange.status == 503 and exchange.complete else f"cut (after {exchange.status})"

