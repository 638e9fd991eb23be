"""``encode-epd-proxy``: an OpenAI-compatible proxy that puts encode-server in front of vLLM servers.

Users change one URL (their OpenAI base URL, to the proxy's); the proxy rewrites each
``POST /v1/chat/completions`` with ``encode_client.epd`` (images and videos go to encode-server; the
prefill server gets an identifier computed from the bytes, with the metadata or the image itself as
the served family's EPD mode says, read once from encode-server's
``GET /v1/model``) and forwards it, and every answer, streamed (SSE) or not, comes back as it arrives::

    encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill-a:8000 --vllm http://prefill-b:8000 \\
        --encoder http://encode-server:8000

Asynchronous (Starlette's ASGI primitives under uvicorn; ``pip install 'encode-client[proxy]'``),
with keep-alive connection pools to vLLM and to encode-server. Several vLLM upstreams: each request
goes to the one with the fewest outstanding requests (``_upstreams``); one that refuses a
connection is skipped for a while and the request goes to the next. At most ``--max-concurrency``
requests at once (past it 503 ``overloaded_error``), bounded bodies and timeouts, OpenAI-shaped
errors. ``GET /health`` and ``GET /metrics`` are the proxy's own (``_proxy_metrics``). SIGTERM
drains: no new connection is accepted, requests in flight (streams too) finish within
``--drain-seconds``.

A request vLLM failed before answering (its EC connector found the embedding neither in Redis nor
at encode-server: vLLM's generic 500, or the same error as a stream's first event,
``_vllm_failure``) is retried ``--retries`` times, after its images and videos are handed off again.

The proxy is the only client of the prefill servers (docs/vllm.md, "Threat model"), so it forwards
only what it checks: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the fields that
steer vLLM's caches refused, ``cache_salt`` derived from the caller's tenant) and the read-only
``GET`` routes in ``FORWARDED``; anything else is a 404. With ``--api-keys`` (``KEY`` or
``TENANT:KEY``, encode-server's list) every route but the probes needs a caller's key, encode-server
is called with that caller's own key (so its tenant isolation applies per caller), and the
caller's ``Authorization`` never reaches vLLM (``--vllm-api-key`` is sent there instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

try:
    import uvicorn
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"encode-epd-proxy needs its extra: pip install 'encode-client[proxy]' ({exc})") from exc

from encode_client._callers import Caller, Callers
from encode_client._client import AsyncClient
from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client._lanes import AsyncLanes
from encode_client._proxy_metrics import ProxyMetrics
from encode_client._proxy_settings import ProxySettings
from encode_client._upstreams import Upstream, Upstreams
from encode_client._vllm_failure import StreamGate, is_generation_error
from encode_client.epd import (
    EpdContract,
    EpdContractError,
    EPDError,
    cache_salt,
    check_chat_request,
    check_request_fields,
    rewrite_chat_plan_async,
)

__all__ = ["FORWARDED", "OPEN_PATHS", "OWN_ROUTES", "EPDProxy", "ProxyApp", "ProxySettings", "build_parser", "main"]

log = logging.getLogger("encode_client.proxy")

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
_CHAT = "/v1/chat/completions"
# Every route vLLM serves that a client may reach through the proxy. Others (the Responses, pooling,
# tokenizer, render, token-in and admin routes) take content the proxy does not check, such as a
# part with a uuid, so they are refused rather than forwarded.
FORWARDED = frozenset(
    {("POST", _CHAT), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/ping"), ("GET", "/version"),
     ("GET", "/load")}
)
OWN_ROUTES = frozenset({("GET", "/health"), ("GET", "/metrics")})  # the proxy's own, never forwarded
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})  # probes: no key needed
_ERROR_BODY_LIMIT = 1 << 20  # a non-streamed 500 read to tell vLLM's generic failure
_LANES = 16  # httpx pools to vLLM and to encode-server, used in turn (``_lanes``: one pool slows down)


def _openai_error(status: int, message: str, kind: str, param: str | None = None, **headers: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(body, status_code=status, headers={**extra, **headers})


class _Refused(Exception):
    """An answer the proxy gives itself instead of forwarding."""

    def __init__(self, response: JSONResponse, kind: str) -> None:
        self.response, self.kind = response, kind


def _refuse(status: int, message: str, kind: str, param: str | None = None, **headers: str) -> _Refused:
    return _Refused(_openai_error(status, message, kind, param, **headers), kind)


@dataclass
class _Exchange:
    """One request's bookkeeping: what the log line and the metrics say, what to release after."""

    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    images: int = 0
    videos: int = 0
    tenant: str | None = None
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


class ProxyApp:
    """The ASGI application (see the module docstring). ``draining`` turns ``/health`` to 503."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.callers = Callers(settings.api_keys) if settings.api_keys else None
        self.upstreams = Upstreams(settings.vllm_urls, down_for=settings.down_for)
        self.metrics = ProxyMetrics()
        self.draining = False
        self.inflight = 0
        self._contract: EpdContract | None = None
        self._http: AsyncLanes | None = None
        self._encoders: dict[str | None, AsyncClient] = {}
        for upstream in self.upstreams.all:
            self.metrics.upstream_up.labels(upstream.url).set(1)
            self.metrics.outstanding.labels(upstream.url).set(0)

    # -- lifespan --------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        pool = httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections)
        timeout = httpx.Timeout(s.timeout, connect=s.connect_timeout, pool=s.connect_timeout)
        self._http = AsyncLanes(_LANES, timeout=timeout, limits=pool)
        keys = [c.key for c in self.callers] if self.callers is not None else [s.api_key]
        self._encoders = {
            k: AsyncClient(list(s.encoder_urls), api_key=k, response="json", timeout=s.encoder_timeout, pool=pool,
                           lanes=_LANES)
            for k in keys
        }

    async def shutdown(self) -> None:
        for encoder in self._encoders.values():
            await encoder.aclose()
        if self._http is not None:
            await self._http.aclose()

    def encoder_for(self, caller: Caller | None) -> AsyncClient:
        """The encode-server client that speaks for ``caller`` (with its key, hence its tenant)."""
        return self._encoders[caller.key if caller is not None else next(iter(self._encoders))]

    async def contract(self, caller: Caller | None) -> EpdContract:
        """The served family's EPD contract (pixel-free or pixels + uuid, and its fields), read from
        encode-server's ``GET /v1/model`` once; a failed read is retried by the next request."""
        if self._contract is None:
            self._contract = EpdContract.from_model(await self.encoder_for(caller).model())
        return self._contract

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        exchange = _Exchange(scope["method"], scope["path"])

        async def send_status(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                exchange.status = int(message["status"])
            await send(message)

        try:
            response = await self._answer(Request(scope, receive), exchange)
            await response(scope, receive, send_status)
        finally:
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
        if exchange.path not in OPEN_PATHS:
            log.info(
                "%s %s %d images=%d videos=%d tenant=%s %.1f ms", exchange.method, exchange.path, exchange.status,
                exchange.images, exchange.videos, exchange.tenant or "-",
                (time.perf_counter() - exchange.started) * 1000,
            )

    # -- one request ----------------------------------------------------------------------------

    async def _answer(self, request: Request, exchange: _Exchange) -> Response:
        try:
            return await self._handle(request, exchange)
        except _Refused as refused:
            self.metrics.errors.labels(refused.kind).inc()
            return refused.response
        except Exception:  # a bug here must still be an OpenAI-shaped answer, and logged
            log.exception("%s %s: the proxy failed", request.method, request.url.path)
            self.metrics.errors.labels("internal_error").inc()
            return _openai_error(500, "the EPD proxy failed on this request (logged)", "internal_error")

    async def _handle(self, request: Request, exchange: _Exchange) -> Response:
        route = (request.method, request.url.path)
        if route == ("GET", "/health"):
            return await self._health()
        if route == ("GET", "/metrics"):
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        if route not in FORWARDED:
            routes = ", ".join(f"{m} {p}" for m, p in sorted(FORWARDED | OWN_ROUTES))
            raise _refuse(404, f"the EPD proxy does not forward {route[0]} {route[1]}; it serves {routes}",
                          "not_found_error")
        caller = None
        if self.callers is not None and request.url.path not in OPEN_PATHS:
            caller = self.callers.authenticate(request.headers.get("authorization"))
            if caller is None:
                raise _refuse(401, "missing or unknown API key: send 'Authorization: Bearer KEY'",
                              "authentication_error")
            exchange.tenant = caller.tenant
        if self.draining:
            raise _refuse(503, "the proxy is shutting down; retry on another", "unavailable_error",
                          **{"Retry-After": "1", "Connection": "close"})
        if self.inflight >= self.settings.max_concurrency:
            raise _refuse(503, f"the proxy is serving {self.inflight} requests, its --max-concurrency; retry",
                          "overloaded_error", **{"Retry-After": "1"})
        self.inflight += 1
        self.metrics.inflight.inc()
        exchange.cleanup.append(self._left)
        body = await self._body(request)
        prepare = self._preparer(request, body, caller, exchange)
        prepared = await prepare()  # counts the request's images and videos
        retryable = exchange.images or exchange.videos
        return await self._forward(request, prepared, prepare if retryable else None, exchange)

    async def _left(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.dec()

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            status = 413 if declared.isdigit() else 400
            raise _refuse(status, f"the body must be at most {limit} bytes (Content-Length {declared!r})",
                          "invalid_request_error")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _refuse(413, f"the body must be at most {limit} bytes", "invalid_request_error")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _refuse(400, "the client went away while sending the body", "invalid_request_error") from None
        return b"".join(chunks)

    def _preparer(
        self, request: Request, body: bytes, caller: Caller | None, exchange: _Exchange
    ) -> Callable[[], Awaitable[bytes]]:
        """The body to send vLLM, made afresh by each call (a retry hands the images and videos off again)."""

        async def prepare() -> bytes:
            if request.method != "POST":
                return body
            try:
                parsed = json.loads(body)
                if not isinstance(parsed, dict):
                    raise EPDError("the body must be a JSON object")
                if request.url.path == _CHAT:
                    started = time.perf_counter()
                    plan = check_chat_request(parsed, trust_client_embeds=self.settings.trust_client_embeds)
                    rewritten, results = await rewrite_chat_plan_async(
                        parsed, plan, self.encoder_for(caller),
                        contract=lambda: self.contract(caller),  # read after the checks, with images or videos
                    )
                    if results:
                        self.metrics.handoff_seconds.observe(time.perf_counter() - started)
                        self.metrics.handoff_images.inc(len(plan.images))
                        self.metrics.handoff_videos.inc(len(plan.videos))
                    exchange.images, exchange.videos = len(plan.images), len(plan.videos)
                else:
                    check_request_fields(parsed)
                    rewritten = dict(parsed)
                rewritten["cache_salt"] = cache_salt(caller.tenant if caller else None, parsed.get("cache_salt"))
            except (ValueError, EPDError) as exc:  # JSONDecodeError is a ValueError
                param = exc.where if isinstance(exc, EPDError) else None
                raise _refuse(400, str(exc), "invalid_request_error", param) from None
            except EpdContractError as exc:  # the served model is not one a vLLM prefill consumes so
                raise _refuse(502, f"encode-server: {exc}", "encoder_error") from None
            except ServerError as exc:
                status = exc.status if 400 <= exc.status < 500 else 503
                raise _refuse(status, f"encode-server: {exc}", "encoder_error") from None
            except ReplicaUnavailable as exc:
                raise _refuse(503, f"encode-server unavailable: {exc}", "encoder_unavailable") from None
            return json.dumps(rewritten).encode()

        return prepare

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.callers is not None or self.settings.vllm_api_key:  # a caller's key stays here
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        if self.settings.vllm_api_key:
            headers["Authorization"] = f"Bearer {self.settings.vllm_api_key}"
        return headers

    async def _forward(
        self, request: Request, body: bytes, prepare: Callable[[], Awaitable[bytes]] | None, exchange: _Exchange
    ) -> Response:
        """Send to an upstream; retry a request vLLM failed before answering (``prepare`` set: it has
        images or videos to hand off again); stream the answer back as it arrives."""
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = self._upstream_headers(request)
        attempt = 0
        while True:
            upstream, answer = await self._send(request.method, target, headers, body)
            release = self._releaser(upstream, answer)
            retry = prepare is not None and attempt < self.settings.retries
            prefix = b""
            chunks = answer.aiter_raw()
            failed = False
            if retry and answer.headers.get("content-type", "").startswith("text/event-stream"):
                gate = StreamGate()
                try:
                    while gate.holding:
                        try:
                            prefix += gate.feed(await chunks.__anext__())
                        except StopAsyncIteration:
                            prefix += gate.finish()
                            break
                except httpx.HTTPError:
                    await release()
                    raise _refuse(502, "vLLM's stream broke before its first event", "upstream_unavailable") from None
                failed = gate.failed
            elif retry and answer.status_code == 500:
                prefix = await answer.aread()
                chunks = _nothing()
                failed = is_generation_error(500, prefix) and len(prefix) < _ERROR_BODY_LIMIT
            if not failed:
                exchange.cleanup.append(release)
                response_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
                return StreamingResponse(
                    _relay(prefix, chunks, request.url.path, self.metrics), status_code=answer.status_code,
                    headers=response_headers,
                )
            await release()
            assert prepare is not None  # retry is False without it
            attempt += 1
            self.metrics.retries.labels("prefill_error").inc()
            log.warning("%s %s: vLLM failed the request before answering; media handed off again, retry %d",
                        request.method, request.url.path, attempt)
            body = await prepare()

    async def _send(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[Upstream, httpx.Response]:
        """The answer's headers from the least busy upstream that takes the connection."""
        assert self._http is not None
        tried: set[str] = set()
        last: Exception | None = None
        while (upstream := self.upstreams.pick(tried)) is not None:
            tried.add(upstream.url)
            self.upstreams.started(upstream)
            self.metrics.outstanding.labels(upstream.url).inc()
            started = time.perf_counter()
            try:
                http = self._http.next()
                request = http.build_request(method, upstream.url + target, content=body, headers=headers)
                answer = await http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._finished(upstream)
                self.upstreams.failed(upstream)
                self.metrics.upstream_up.labels(upstream.url).set(0)
                last = exc
                if len(tried) < len(self.upstreams.all):
                    self.metrics.retries.labels("connect").inc()
                continue
            except httpx.PoolTimeout:
                self._finished(upstream)
                raise _refuse(503, "no connection to vLLM free in time (--max-connections)", "overloaded_error",
                              **{"Retry-After": "1"}) from None
            except httpx.TimeoutException:
                self._finished(upstream)
                raise _refuse(504, f"vLLM at {upstream.url} did not answer within {self.settings.timeout} s",
                              "upstream_timeout") from None
            except httpx.HTTPError as exc:
                self._finished(upstream)
                raise _refuse(502, f"vLLM server at {upstream.url} failed: {exc!r}", "upstream_unavailable") from None
            self.metrics.upstream_seconds.labels(upstream.url).observe(time.perf_counter() - started)
            self.metrics.upstream_up.labels(upstream.url).set(1)
            return upstream, answer
        raise _refuse(502, f"vLLM server unreachable: {last!r}", "upstream_unavailable")

    def _finished(self, upstream: Upstream) -> None:
        self.upstreams.finished(upstream)
        self.metrics.outstanding.labels(upstream.url).dec()

    def _releaser(self, upstream: Upstream, answer: httpx.Response) -> Callable[[], Awaitable[None]]:
        done = False

        async def release() -> None:
            nonlocal done
            if not done:
                done = True
                await answer.aclose()
                self._finished(upstream)

        return release

    async def _health(self) -> Response:
        if self.draining:
            return _openai_error(503, "draining", "unavailable_error", **{"Retry-After": "1"})
        assert self._http is not None
        http = self._http.next()
        timeout = min(2.0, self.settings.connect_timeout)

        async def probe(upstream: Upstream) -> bool:
            try:
                return (await http.get(upstream.url + "/health", timeout=timeout)).status_code == 200
            except httpx.HTTPError:
                return False

        states = await asyncio.gather(*(probe(u) for u in self.upstreams.all))
        for upstream, up in zip(self.upstreams.all, states, strict=True):
            self.metrics.upstream_up.labels(upstream.url).set(int(up))
        report = {u.url: "up" if up else "down" for u, up in zip(self.upstreams.all, states, strict=True)}
        if not any(states):
            self.metrics.errors.labels("upstream_unavailable").inc()
            return _openai_error(502, f"no vLLM upstream answers /health: {report}", "upstream_unavailable")
        return JSONResponse({"status": "ok", "upstreams": report, "inflight": self.inflight})


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


class _Server(uvicorn.Server):
    """uvicorn, telling the app it drains as soon as a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, app: ProxyApp) -> None:
        super().__init__(config)
        self.proxy_app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.proxy_app.draining = True
        super().handle_exit(sig, frame)


class EPDProxy:
    """The proxy on a socket of its own, bound at construction (so ``url`` is known at once):
    ``serve_forever()`` runs it (in a thread of a program or a test, or the CLI's main thread,
    where SIGTERM drains it), ``shutdown()`` from another thread drains and stops it."""

    def __init__(
        self, listen: tuple[str, int], vllm_url: str | Sequence[str], encoder_urls: Sequence[str], **options: Any
    ) -> None:
        """``options``: the fields of ``ProxySettings`` (``api_key``: encode-server's key for every
        caller; ``api_keys``: the callers' keys, each used as its own caller's encode-server key;
        ``trust_client_embeds``: let callers send embeddings; timeouts and limits)."""
        vllm_urls = (vllm_url,) if isinstance(vllm_url, str) else tuple(vllm_url)
        self.settings = ProxySettings(vllm_urls=vllm_urls, encoder_urls=tuple(encoder_urls), **options)
        self.app = ProxyApp(self.settings)
        self._sock = socket.create_server(listen, backlog=2048)
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", server_header=False, interface="asgi3",
            timeout_graceful_shutdown=math.ceil(self.settings.drain_seconds),
            timeout_keep_alive=math.ceil(self.settings.keep_alive_timeout),
        )
        self._server = _Server(config, self.app)
        self._done = threading.Event()

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def vllm_url(self) -> str:
        return self.settings.vllm_urls[0]

    def serve_forever(self) -> None:
        """Serve until ``shutdown()`` or a signal; on uvicorn's event loop (uvloop when installed)."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._done.set()

    def shutdown(self) -> None:
        self.app.draining = True
        self._server.should_exit = True
        self._done.wait(self.settings.drain_seconds + 10)

    def server_close(self) -> None:
        self._sock.close()


def _address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The command line (docs/vllm.md's proxy flag table lists exactly these flags; a test checks)."""
    parser = argparse.ArgumentParser(prog="encode-epd-proxy", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--listen", type=_address, default=("127.0.0.1", 8080), help="HOST:PORT (default 127.0.0.1:8080)"
    )
    parser.add_argument(
        "--vllm", action="append", required=True,
        help="a vLLM (prefill) server's base URL, e.g. http://127.0.0.1:8000 (repeatable: least outstanding requests)",
    )
    parser.add_argument(
        "--encoder", action="append", required=True, help="encode-server replica URL (repeatable)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("ENCODE_CLIENT_API_KEY"),
        help="encode-server API key for every caller (callers are not authenticated); env ENCODE_CLIENT_API_KEY",
    )
    parser.add_argument(
        "--api-keys", default=os.environ.get("ENCODE_EPD_PROXY_API_KEYS"),
        help="the callers' keys, comma-separated KEY or TENANT:KEY (encode-server's list): each caller is "
        "authenticated and calls encode-server with its own key; env ENCODE_EPD_PROXY_API_KEYS",
    )
    parser.add_argument(
        "--vllm-api-key", default=os.environ.get("ENCODE_EPD_PROXY_VLLM_API_KEY"),
        help="sent to vLLM (its --api-key) instead of the caller's Authorization; env ENCODE_EPD_PROXY_VLLM_API_KEY",
    )
    parser.add_argument(
        "--trust-client-embeds", action="store_true",
        help="accept image/video/audio embeddings parts from callers, each named by the content hash of its "
        "payload (never the client's uuid); only for a proxy whose every caller is trusted",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds vLLM may take for its next byte")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to vLLM")
    parser.add_argument(
        "--encoder-timeout", type=float, default=60.0, help="seconds for one call to encode-server (the hand-off)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=512, help="requests served at once; past it 503 overloaded_error"
    )
    parser.add_argument(
        "--max-connections", type=int, default=1024, help="keep-alive connections to vLLM and to encode-server"
    )
    parser.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024, help="largest request body")
    parser.add_argument(
        "--retries", type=int, default=1,
        help="times a request vLLM failed before answering is sent again, after its images and videos are handed off "
        "again",
    )
    parser.add_argument(
        "--drain-seconds", type=float, default=30.0, help="on SIGTERM, how long requests in flight may take to finish"
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {
        "api_key": args.api_key, "api_keys": args.api_keys, "vllm_api_key": args.vllm_api_key,
        "trust_client_embeds": args.trust_client_embeds, "timeout": args.timeout,
        "connect_timeout": args.connect_timeout, "encoder_timeout": args.encoder_timeout,
        "max_concurrency": args.max_concurrency, "max_connections": args.max_connections,
        "max_body_bytes": args.max_body_bytes, "retries": args.retries, "drain_seconds": args.drain_seconds,
    }
    try:
        proxy = EPDProxy(args.listen, args.vllm, args.encoder, **options)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    log.info(
        "EPD proxy on %s -> vLLM %s, encode-server %s; %s; client embeddings %s",
        proxy.url, ", ".join(proxy.settings.vllm_urls), ", ".join(args.encoder),
        f"{len(proxy.app.callers)} caller key(s)" if proxy.app.callers else "callers not authenticated",
        "accepted (re-keyed by content)" if args.trust_client_embeds else "refused",
    )
    # uvicorn re-raises the signal that stopped it once it has drained; with this handler that
    # ends the process with status 0, after the drain, instead of by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    log.info("EPD proxy stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

