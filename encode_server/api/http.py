"""The HTTP front door: parse, call the service, map errors. No logic of its own.

Routes are bound methods of ``HttpApi``, which holds the ``Runtime`` it serves: no closures over
app state, no globals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
import pybase64
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from encode_server import __version__
from encode_server.api.bodies import parse_encode_body, parse_lookup_body, parse_tokens_body
from encode_server.api.budget import BodyBudgetMiddleware, body_hold
from encode_server.api.frontdoor import (
    RequestRecord,
    authorize,
    cancelled_by_stop,
    item_fields,
    new_request_id,
    record_request,
    retry_after,
)
from encode_server.api.model import describe_model
from encode_server.api.openapi import request_body_doc
from encode_server.api.runtime import Runtime, shutting_down
from encode_server.api.schemas import (
    EncodeRequestIn,
    EncodeResponseOut,
    ErrorOut,
    LookupRequestIn,
    LookupResponseOut,
    TokensRequestIn,
    TokensResponseOut,
)
from encode_server.api.status import STATUS, status_for
from encode_server.core.errors import EncodeServerError, InvalidRequest, Unauthorized, Unavailable
from encode_server.core.types import ItemResult, Return
from encode_server.core.wire import WireTensor, safetensors_parts
from encode_server.metrics import CONTENT_TYPE_LATEST
from encode_server.service import EncodeService

if TYPE_CHECKING:  # pyzmq is an optional extra: the door is imported only where --sglang builds it
    from encode_server.api.sglang import SglangDoor

__all__ = ["HotRoutes", "HttpApi", "create_app", "response_for"]

log = logging.getLogger(__name__)

SAFETENSORS = "application/vnd.safetensors"
# JSON answers base64 their tensors (SIMD, then orjson: ~1 ms per MiB); past this many bytes of
# embeddings that leaves the loop. A safetensors answer is never copied, so it never needs to.
_JSON_OFF_LOOP_BYTES = 8 << 20


class PartsResponse(Response):
    """A body written as the parts it is made of (a safetensors header, then each tensor's bytes
    as the cache holds them), with its Content-Length: the embedding bytes are never joined."""

    def __init__(self, parts: Sequence[bytes], media_type: str) -> None:
        super().__init__(media_type=media_type)
        self.parts = parts
        self.headers["content-length"] = str(sum(len(p) for p in parts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})
        if last < 0:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_response(exc: EncodeServerError) -> JSONResponse:
    headers = {}
    if (seconds := retry_after(exc)) is not None:
        headers["Retry-After"] = seconds
    elif isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"type": exc.type, "message": exc.message, "index": exc.index}}
    return JSONResponse(body, status_code=status_for(exc), headers=headers)


def _error_doc(*types: str) -> dict[str, Any]:
    return {"model": ErrorOut, "description": "error types: " + ", ".join(types)}


# Every error the service answers, per HTTP status, from the error classes' own registry
# (``core/errors.py``: ``types``): nothing to keep by hand.
_ENCODE_ERRORS: dict[int | str, dict[str, Any]] = {status: _error_doc(*cls.types) for cls, status in STATUS}


def _record(request: Request) -> RequestRecord:
    """The request's accounting record, made by ``MetricsMiddleware``."""
    record: RequestRecord = request.scope["state"]["record"]
    return record


class HttpApi:
    """The routes, as bound methods over the ``Runtime`` they serve: no closures over app state."""

    def __init__(self, runtime: Runtime, *, health_is_readiness: bool = False) -> None:
        self.runtime = runtime
        # --sglang: SGLang's prefill polls /health to keep an encoder in its rotation, and its own
        # encoder answers 503 until it can encode; so does this one then, loading and draining.
        self.health_is_readiness = health_is_readiness

    def _tenant(self, request: Request) -> str | None:
        """Authenticate a /v1 request; the tenant that keys its cache entries (None: shared)."""
        return authorize(self.runtime, request.headers.get("authorization"), _record(request))

    async def encode(self, request: Request) -> Response:
        """Resolve images (uploads, hashes, or both) to embeddings: tiers first, encoder last."""
        s = self.runtime.settings
        tenant = self._tenant(request)
        service = self.runtime.require_service()
        body = await parse_encode_body(request, max_items=s.max_items, max_bytes=s.max_request_bytes,
                                       hold=body_hold(request.scope))
        record = _record(request)
        record.read_at = time.perf_counter()
        record.items = len(body.items)
        results = await service.encode(body.items, return_kind=body.return_kind, tenant=tenant)
        record.resolved_at = time.perf_counter()
        record.hits = sum(r.status == "hit" for r in results)
        safetensors = SAFETENSORS in request.headers.get("accept", "") and body.return_kind is Return.EMBEDDINGS
        render = (
            partial(self._safetensors, service, results)
            if safetensors
            else partial(self._json, service, results, body.return_kind)
        )
        # Base64 of many MiB would stall every other request: leave the loop for it.
        nbytes = sum(r.embedding.nbytes for r in results if r.embedding is not None)
        if not safetensors and nbytes > _JSON_OFF_LOOP_BYTES:
            return await asyncio.to_thread(render)
        return render()

    def _json(self, service: EncodeService, results: list[ItemResult], return_kind: Return) -> Response:
        items = [_item_json(r, return_kind) for r in results]
        served = service.describe()
        content = {"model": served.model, "fingerprint": served.fingerprint, "items": items}
        return Response(orjson.dumps(content), media_type="application/json")

    def _safetensors(self, service: EncodeService, results: list[ItemResult]) -> Response:
        tensors = [
            WireTensor(str(r.index), r.embedding.tensor.dtype, r.embedding.tensor.shape, r.embedding.tensor.data)
            for r in results
            if r.embedding is not None
        ]
        served = service.describe()
        metadata = {
            "model": served.model,
            "fingerprint": served.fingerprint,
            "items": orjson.dumps([item_fields(r, Return.EMBEDDINGS) for r in results]).decode(),
        }
        return PartsResponse(safetensors_parts(tensors, metadata), SAFETENSORS)

    async def lookup(self, request: Request) -> Response:
        """Which tier holds each hash: no bytes move; cheap enough for a router on every request."""
        s = self.runtime.settings
        tenant = self._tenant(request)
        service = self.runtime.require_service()
        body = await parse_lookup_body(request, max_hashes=s.max_light_items, max_bytes=s.max_request_bytes,
                                       hold=body_hold(request.scope))
        found = await service.lookup(body.hashes, tenant=tenant, modality=body.modality, settings=body.settings)
        record = _record(request)
        record.items, record.hits = len(found), sum(f.cached for f in found)
        return JSONResponse({"items": [{"hash": f.mm_hash, "cached": f.cached, "tier": f.tier} for f in found]})

    async def tokens(self, request: Request) -> Response:
        """Token count and grid per image without running the encoder: uploads or sizes."""
        s = self.runtime.settings
        self._tenant(request)  # authenticates; token counts are not tenant data
        service = self.runtime.require_service()
        body = await parse_tokens_body(
            request, max_items=s.max_items, max_sizes=s.max_light_items, max_bytes=s.max_request_bytes,
            hold=body_hold(request.scope),
        )
        counts = await service.tokens(items=body.items, sizes=body.sizes, settings=body.settings)
        _record(request).items = len(counts)
        items = [
            {"index": c.index, "num_tokens": c.num_tokens, "width": c.width, "height": c.height, "meta": c.meta}
            for c in counts
        ]
        served = service.describe()
        return JSONResponse({"model": served.model, "fingerprint": served.fingerprint, "items": items})

    async def model(self, request: Request) -> Response:
        """The loaded model, its fingerprint, preprocessing, batching and limits."""
        self._tenant(request)
        return JSONResponse(describe_model(self.runtime.require_service()))

    async def health(self) -> Response:
        """The process is alive (liveness); with ``--sglang``, ready to encode (what SGLang reads it as)."""
        if self.health_is_readiness and not self.runtime.ready:
            return await self.ready()
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        """200 only when the model is loaded and warm and the server is not draining."""
        if self.runtime.ready:
            return JSONResponse({"status": "ready"})
        reason = "draining" if self.runtime.draining else "loading"
        return error_response(Unavailable(f"not ready: {reason}", type="not_ready", retry_after=5.0))

    async def metrics(self) -> Response:
        return Response(self.runtime.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _item_json(r: ItemResult, return_kind: Return) -> dict[str, Any]:
    out = item_fields(r, return_kind)
    if return_kind is Return.EMBEDDINGS and r.embedding is not None:
        out["embedding"] = pybase64.b64encode_as_string(r.embedding.tensor.data)
    return out


class MetricsMiddleware:
    """Every HTTP request through :func:`record_request` (the accounting both doors share), plus
    the ``X-Request-ID`` echo. Pure ASGI (not BaseHTTPMiddleware) so large responses stream
    through untouched. Routes fill the record's ``items``, ``hits`` and ``tenant``."""

    def __init__(self, app: ASGIApp, runtime: Runtime, routes: frozenset[str]) -> None:
        self.app = app
        self.runtime = runtime
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        client_id = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        record = RequestRecord(
            protocol="http", method=scope["method"], route=path if path in self.routes else "other",
            request_id=new_request_id(client_id),
        )
        scope.setdefault("state", {})["record"] = record
        echo = (b"x-request-id", record.request_id.encode())

        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.code = message["status"]
                message["headers"] = [*message.get("headers", ()), echo]
            elif message["type"] == "http.response.body":
                record.sent += len(message.get("body", b""))
            await send(message)

        with record_request(self.runtime, record):
            try:
                await self.app(scope, receive, send_wrapper)
            except asyncio.CancelledError:
                if not cancelled_by_stop(self.runtime):
                    raise
                # Answered 503, never uvicorn's 500 and traceback. A response already under way
                # is cut (the connection closes), as a stop must.
                if not started:
                    await error_response(shutting_down())(scope, receive, send_wrapper)


def create_app(runtime: Runtime, sglang: SglangDoor | None = None) -> FastAPI:
    """The HTTP front door over ``runtime``: it serves whatever service the composition root
    (``encode_server.app``) hands the runtime, and says 503 ``not_ready`` until then. With
    ``sglang`` (``--sglang``), SGLang's encoder routes too (``api/sglang.py``)."""
    api = HttpApi(runtime, health_is_readiness=sglang is not None)
    app = FastAPI(title="encode-server", version=__version__)
    routes = frozenset({"/v1/encode", "/v1/lookup", "/v1/tokens", "/v1/model", "/health", "/ready", "/metrics",
                        *(("/encode", "/scheduler_receive_url") if sglang is not None else ())})
    app.add_middleware(HotRoutes, handlers={"/v1/encode": api.encode, "/v1/lookup": api.lookup})
    app.add_middleware(BodyBudgetMiddleware, runtime=runtime)  # inside MetricsMiddleware: its 503s are counted
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
    if sglang is not None:
        sglang.install(app)
    _install_error_handlers(app)
    return app


def _http_error(exc: StarletteHTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    body = {"error": {"type": kind, "message": str(exc.detail), "index": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def response_for(request: Request, exc: Exception) -> Response:
    """The answer to a route's exception: what the FastAPI handlers and ``HotRoutes`` both send."""
    if isinstance(exc, EncodeServerError):
        return error_response(exc)
    if isinstance(exc, RequestValidationError):
        return error_response(InvalidRequest(str(exc)))
    if isinstance(exc, StarletteHTTPException):
        return _http_error(exc)
    if isinstance(exc, ClientDisconnect):
        # The client went away mid-body (or a body timeout closed it): nobody reads this answer;
        # 499 (nginx's "client closed request") keeps it out of the 5xx that alerts count.
        return Response(status_code=499)
    log.error("unexpected error on %s", request.url.path, exc_info=exc)
    body = {"error": {"type": "internal", "message": "internal server error", "index": None}}
    return JSONResponse(body, status_code=500)


class HotRoutes:
    """``POST`` to the hot routes (/v1/encode, /v1/lookup) straight to their handlers, past
    FastAPI's router and dependency machinery: about a fifth of a cached hit's time in the server.
    The same handlers and the same error answers (``response_for``) as the FastAPI routes, which
    stay registered for the OpenAPI document and for every other method."""

    def __init__(self, app: ASGIApp, handlers: Mapping[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except _ROUTE_ERRORS as exc:
            response = response_for(request, exc)
        # Anything else goes up as from a FastAPI route: the budget middleware answers OverBudget,
        # and Starlette's outermost error middleware the unexpected (500, logged).
        await response(scope, receive, send)


# What a route's own exception handlers answer (FastAPI's ExceptionMiddleware, inside ours);
# ``Exception`` is answered by Starlette's outermost middleware, outside ours.
_ROUTE_ERRORS = (EncodeServerError, RequestValidationError, StarletteHTTPException, ClientDisconnect)


def _install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> Response:
        return response_for(request, exc)

    for kind in (*_ROUTE_ERRORS, Exception):
        app.add_exception_handler(kind, handle)
