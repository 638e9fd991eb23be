"""The HTTP front door: parse, call the service, map errors. No logic of its own.

Routes are bound methods of ``HttpApi``, which holds the ``Runtime`` it serves: no closures over
app state, no globals.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from encode_server import __version__
from encode_server.api.bodies import parse_encode_body, parse_lookup_body, parse_tokens_body
from encode_server.api.grpc import start_grpc_server
from encode_server.api.openapi import request_body_doc
from encode_server.api.runtime import Runtime
from encode_server.api.schemas import (
    EncodeRequestIn,
    EncodeResponseOut,
    ErrorOut,
    LookupRequestIn,
    LookupResponseOut,
    TokensRequestIn,
    TokensResponseOut,
)
from encode_server.api.status import status_for
from encode_server.cache.base import SharedTier
from encode_server.cache.redis import create_redis_tier, redact_url
from encode_server.core.errors import (
    EncodeServerError,
    InvalidRequest,
    Unauthorized,
    Unavailable,
)
from encode_server.core.stored import ValueSpec
from encode_server.core.types import ItemResult
from encode_server.core.wire import WireTensor, dump_safetensors
from encode_server.encoders.base import VisionEncoder
from encode_server.logs import ACCESS_LOGGER
from encode_server.metrics import CONTENT_TYPE_LATEST
from encode_server.service import EncodeService, model_fingerprint

__all__ = ["HttpApi", "create_app"]

log = logging.getLogger(__name__)
access_log = logging.getLogger(ACCESS_LOGGER)

SAFETENSORS = "application/vnd.safetensors"
_RENDER_OFF_LOOP_BYTES = 256 << 10



def error_response(exc: EncodeServerError) -> JSONResponse:
    headers = {}
    if isinstance(exc, Unavailable):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    elif isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"type": exc.type, "message": exc.message, "index": exc.index}}
    return JSONResponse(body, status_code=status_for(exc), headers=headers)


def _error_doc(*types: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": "error types: " + ", ".join(types)}


_ENCODE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error_doc(
        "invalid_json", "invalid_base64", "invalid_hash", "hash_mismatch", "invalid_image", "unsupported_image"
    ),
    401: _error_doc("unauthorized"),
    409: _error_doc("no_shared_tier"),
    413: _error_doc("payload_too_large", "image_too_large", "too_many_items", "value_too_large"),
    415: _error_doc("unsupported_media_type"),
    422: _error_doc("invalid_request"),
    503: _error_doc("overloaded", "not_ready", "shared_tier_unavailable"),
    504: _error_doc("timeout"),
}


class HttpApi:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def _tenant(self, request: Request) -> str | None:
        """Authenticate a /v1 request; the tenant that keys its cache entries (None: shared)."""
        tenant = self.runtime.authenticate(request.headers.get("authorization"))
        request.state.tenant = tenant
        return self.runtime.cache_tenant(tenant)

    async def encode(self, request: Request) -> Response:
        """Resolve images (uploads, hashes, or both) to embeddings: tiers first, encoder last."""
        s = self.runtime.settings
        tenant = self._tenant(request)
        service = self.runtime.require_service()
        body = await parse_encode_body(request, max_items=s.max_items, max_bytes=s.max_request_bytes)
        request.state.items = len(body.items)
        results = await service.encode(body.items, want_embeddings=body.want_embeddings, tenant=tenant)
        request.state.hits = sum(r.status == "hit" for r in results)
        safetensors = SAFETENSORS in request.headers.get("accept", "") and body.want_embeddings
        render = (
            partial(self._safetensors, service, results)
            if safetensors
            else partial(self._json, service, results, body.want_embeddings)
        )
        # Base64 and copies of many MiB would stall every other request: leave the loop for them.
        if sum(r.embedding.nbytes for r in results if r.embedding is not None) > _RENDER_OFF_LOOP_BYTES:
            return await asyncio.to_thread(render)
        return render()

    def _json(self, service: EncodeService, results: list[ItemResult], want_embeddings: bool) -> Response:
        items = [_item_json(r, with_embedding=want_embeddings, with_key=not want_embeddings) for r in results]
        content = {"model": service.encoder.info.model_id, "fingerprint": service.fingerprint, "items": items}
        return Response(json.dumps(content, separators=(",", ":")).encode(), media_type="application/json")

    def _safetensors(self, service: EncodeService, results: list[ItemResult]) -> Response:
        tensors = [
            WireTensor(str(r.index), r.embedding.tensor.dtype, r.embedding.tensor.shape, r.embedding.tensor.data)
            for r in results
            if r.embedding is not None
        ]
        metadata = {
            "model": service.encoder.info.model_id,
            "fingerprint": service.fingerprint,
            "items": json.dumps([_item_json(r, with_embedding=False, with_key=False) for r in results]),
        }
        return Response(dump_safetensors(tensors, metadata), media_type=SAFETENSORS)

    async def lookup(self, request: Request) -> Response:
        """Which tier holds each hash: no bytes move; cheap enough for a router on every request."""
        s = self.runtime.settings
        tenant = self._tenant(request)
        service = self.runtime.require_service()
        hashes = await parse_lookup_body(request, max_hashes=s.max_light_items, max_bytes=s.max_request_bytes)
        found = await service.lookup(hashes, tenant=tenant)
        request.state.items = len(found)
        request.state.hits = sum(f.cached for f in found)
        return JSONResponse({"items": [{"hash": f.mm_hash, "cached": f.cached, "tier": f.tier} for f in found]})

    async def tokens(self, request: Request) -> Response:
        """Token count and grid per image without running the encoder: uploads or sizes."""
        s = self.runtime.settings
        self._tenant(request)  # authenticates; token counts are not tenant data
        service = self.runtime.require_service()
        body = await parse_tokens_body(
            request, max_items=s.max_items, max_sizes=s.max_light_items, max_bytes=s.max_request_bytes
        )
        counts = await service.tokens(items=body.items, sizes=body.sizes)
        items = [
            {"index": c.index, "num_tokens": c.num_tokens, "width": c.width, "height": c.height, "meta": c.meta}
            for c in counts
        ]
        info = service.encoder.info
        return JSONResponse({"model": info.model_id, "fingerprint": service.fingerprint, "items": items})

    async def model(self, request: Request) -> Response:
        """The loaded model, its fingerprint, preprocessing, batching and limits."""
        self._tenant(request)
        return JSONResponse(self.runtime.require_service().describe())

    async def health(self) -> Response:
        """The process is alive (liveness)."""
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        """200 only when the model is loaded and warm and the server is not draining."""
        if self.runtime.ready:
            return JSONResponse({"status": "ready"})
        reason = "draining" if self.runtime.draining else "loading"
        return error_response(Unavailable(f"not ready: {reason}", type="not_ready", retry_after=5.0))

    async def metrics(self) -> Response:
        return Response(self.runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _item_json(r: ItemResult, *, with_embedding: bool, with_key: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"index": r.index, "hash": r.mm_hash, "status": r.status, "source": r.source}
    if r.embedding is not None:
        t = r.embedding.tensor
        out.update(num_tokens=r.embedding.num_tokens, shape=list(t.shape), dtype=t.dtype, meta=r.embedding.meta)
        if with_embedding:
            out["embedding"] = base64.b64encode(t.data).decode("ascii")
    if with_key:
        out["key"] = r.key
    return out


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from(scope: Scope) -> str:
    """The client's ``X-Request-ID`` when it is a plain token (safe in a log line), else a new one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _REQUEST_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


class MetricsMiddleware:
    """Per request: requests_total, request_seconds, inflight_requests, response_bytes_total, the
    in-flight count that draining waits on, the ``X-Request-ID`` echo and the one access-log line.

    Pure ASGI (not BaseHTTPMiddleware) so large responses stream through untouched. Routes report
    ``items`` and ``hits`` through ``request.state`` (the ASGI scope's ``state``). The log line
    holds no header but the request id: an API key can never reach it."""

    def __init__(self, app: ASGIApp, runtime: Runtime, routes: frozenset[str]) -> None:
        self.app = app
        self.runtime = runtime
        self.metrics = runtime.metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.routes else "other"
        request_id = request_id_from(scope)
        state: dict[str, Any] = scope.setdefault("state", {})
        code = 500
        sent = 0
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal code, sent
            if message["type"] == "http.response.start":
                code = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        self.metrics.inflight_requests.inc()
        try:
            with self.runtime.serving():
                await self.app(scope, receive, send_wrapper)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.inflight_requests.dec()
            self.metrics.requests.labels(route=route, code=str(code)).inc()
            self.metrics.request_seconds.labels(route=route).observe(elapsed)
            self.metrics.response_bytes.inc(sent)
            # Probes and scrapes go to debug (every few seconds, they would drown the rest), but for
            # a failing /health or /metrics; /ready's 503 while loading or draining is expected.
            quiet = route == "/ready" or (route in ("/health", "/metrics") and code < 400)
            level = logging.DEBUG if quiet else logging.INFO
            self._log(level, scope["method"], route, code, state, elapsed, request_id)

    @staticmethod
    def _log(
        level: int, method: str, route: str, code: int, state: dict[str, Any], elapsed: float, request_id: str
    ) -> None:
        items, hits = int(state.get("items", 0)), int(state.get("hits", 0))
        fields = {
            "request_id": request_id, "method": method, "route": route, "code": code, "items": items,
            "hits": hits, "duration_ms": round(elapsed * 1000, 2), "tenant": state.get("tenant"),
        }
        access_log.log(
            level, "%s %s %d items=%d hits=%d %.1fms id=%s",
            method, route, code, items, hits, elapsed * 1000, request_id, extra={"fields": fields},
        )


def create_app(runtime: Runtime, load_encoder: Callable[[], VisionEncoder]) -> FastAPI:
    """Wire a server: ``load_encoder`` runs in a thread after start-up, so ``/health`` answers
    (and ``/ready`` says 503) while a large model loads."""
    api = HttpApi(runtime)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # gRPC shares this event loop; its health says NOT_SERVING until the model is ready.
        grpc_server = await start_grpc_server(runtime) if runtime.settings.grpc_port else None
        loader = asyncio.create_task(_load(runtime, load_encoder))
        try:
            yield
        finally:
            runtime.draining = True
            if grpc_server is not None:
                await grpc_server.stop(grace=3)  # HTTP and gRPC calls were drained already
            loader.cancel()
            if runtime.service is not None:
                await runtime.service.close()

    app = FastAPI(title="encode-server", version=__version__, lifespan=lifespan)
    routes = frozenset({"/v1/encode", "/v1/lookup", "/v1/tokens", "/v1/model", "/health", "/ready", "/metrics"})
    app.add_middleware(MetricsMiddleware, runtime=runtime, routes=routes)
    common: dict[int | str, dict[str, Any]] = {503: _error_doc("not_ready")}
    app.add_api_route(
        "/v1/encode",
        api.encode,
        methods=["POST"],
        response_model=EncodeResponseOut,
        responses={200: {"content": {SAFETENSORS: {}}}, **_ENCODE_ERRORS},
        openapi_extra=request_body_doc(
            EncodeRequestIn, "multipart/form-data", "image/*", "application/octet-stream"
        ),
    )
    app.add_api_route(
        "/v1/lookup",
        api.lookup,
        methods=["POST"],
        response_model=LookupResponseOut,
        responses={k: v for k, v in _ENCODE_ERRORS.items() if k in (400, 401, 413, 415, 422, 503)},
        openapi_extra=request_body_doc(LookupRequestIn),
    )
    app.add_api_route(
        "/v1/tokens",
        api.tokens,
        methods=["POST"],
        response_model=TokensResponseOut,
        responses={k: v for k, v in _ENCODE_ERRORS.items() if k != 409},
        openapi_extra=request_body_doc(
            TokensRequestIn, "multipart/form-data", "image/*", "application/octet-stream"
        ),
    )
    app.add_api_route("/v1/model", api.model, methods=["GET"], responses={**common, 401: _error_doc("unauthorized")})
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/ready", api.ready, methods=["GET"], responses=common)
    app.add_api_route("/metrics", api.metrics, methods=["GET"], include_in_schema=False)
    _install_error_handlers(app)
    return app


async def _load(runtime: Runtime, load_encoder: Callable[[], VisionEncoder]) -> None:
    try:
        started = time.perf_counter()
        encoder = await asyncio.to_thread(load_encoder)
        service = EncodeService(encoder, runtime.settings, runtime.metrics, shared=_shared_tier(runtime, encoder))
        await service.start()
        runtime.service = service
        info = encoder.info
        log.info(
            "model %s loaded and warm in %.2f s: kind=%s device=%s dtype=%s fingerprint=%s",
            info.model_id, time.perf_counter() - started, info.kind, info.device, info.dtype, service.fingerprint,
        )
        if info.meaningless:
            log.warning(
                "%s has random weights: its embeddings are deterministic but MEANINGLESS; "
                "pass --model for a real encoder", info.model_id,
            )
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        runtime.load_error = exc
        log.exception("model failed to load; shutting down")
        os.kill(os.getpid(), signal.SIGTERM)


def _shared_tier(runtime: Runtime, encoder: VisionEncoder) -> SharedTier | None:
    """The Redis tier when ``--redis-url`` is set. It checks every value it reads against this
    model's fingerprint, dtype and hidden size."""
    s = runtime.settings
    if not s.redis_url:
        return None
    info = encoder.info
    spec = ValueSpec(model_fingerprint(info), info.dtype, info.hidden_size)
    tier = create_redis_tier(s, runtime.metrics, spec)
    log.info("shared tier: %s (%s), ttl %d s", tier.name, redact_url(s.redis_url), s.redis_ttl)
    return tier


def _install_error_handlers(app: FastAPI) -> None:
    async def on_domain_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, EncodeServerError)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return error_response(InvalidRequest(str(exc)))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = {"error": {"type": kind, "message": str(exc.detail), "index": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        # The client went away mid-body (or a body timeout closed it): nobody reads this answer;
        # 499 (nginx's "client closed request") keeps it out of the 5xx that alerts count.
        return Response(status_code=499)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        body = {"error": {"type": "internal", "message": "internal server error", "index": None}}
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(EncodeServerError, on_domain_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
