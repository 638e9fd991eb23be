"""The gRPC front door (docs/api.md): parse, call the same ``EncodeService``, map errors.

Same items, statuses, limits and error ``type``s as HTTP. An error is a gRPC status code
(``CODES`` below) whose details start with ``"{type}: "``, with the HTTP error's ``type`` also in
the trailing metadata key ``error-type``, the
failing item in ``error-index`` and, for UNAVAILABLE, ``retry-after`` seconds. 413 maps to
RESOURCE_EXHAUSTED, which is also what gRPC itself answers for a message above the receive limit
(that one carries no ``error-type``; clients read it as ``payload_too_large``).

Auth is one call site: ``GrpcApi._authorize`` hands the ``authorization`` metadata to
``Runtime.authenticate``, the same keys and tenant rule as HTTP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encode_server.api.budget import GRPC_BUDGET_OPTIONS, GrpcBudgetInterceptor
from encode_server.api.frontdoor import (
    RequestRecord,
    authorize,
    cancelled_by_stop,
    check_count,
    item_fields,
    item_settings,
    new_request_id,
    record_request,
    request_item,
    retry_after,
)
from encode_server.api.grpc_decode import add_encoder_servicer, check_decoded
from encode_server.api.model import describe_model
from encode_server.api.ports import PortUnavailable, check_bindable
from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from encode_server.api.runtime import Runtime, shutting_down
from encode_server.api.status import status_for
from encode_server.core.errors import (
    BadInput,
    Conflict,
    EncodeServerError,
    InvalidRequest,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)
from encode_server.core.types import AUDIO, IMAGE, VIDEO, ItemResult, RequestItem, Return
from encode_server.service import EncodeService

__all__ = ["CODES", "SERVICE_NAME", "GrpcApi", "HealthApi", "code_for", "start_grpc_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = "encode_server.v1.Encoder"

CODES: tuple[tuple[type[EncodeServerError], grpc.StatusCode], ...] = (
    (BadInput, grpc.StatusCode.INVALID_ARGUMENT),  # 400
    (Unauthorized, grpc.StatusCode.UNAUTHENTICATED),  # 401
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),  # 409
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),  # 413
    (UnsupportedMediaType, grpc.StatusCode.INVALID_ARGUMENT),  # 415
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),  # 422
    (Unavailable, grpc.StatusCode.UNAVAILABLE),  # 503
    (Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),  # 504
)

# Protobuf framing around the request's bytes; the body itself is held to --max-request-bytes.
_FRAMING_SLACK = 64 * 1024

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def code_for(exc: EncodeServerError) -> grpc.StatusCode:
    for cls, code in CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_metadata(exc: EncodeServerError) -> tuple[tuple[str, str], ...]:
    md = [("error-type", exc.type)]
    if exc.index is not None:
        md.append(("error-index", str(exc.index)))
    if (seconds := retry_after(exc)) is not None:
        md.append(("retry-after", seconds))
    return tuple(md)


_MODALITIES = {pb.MODALITY_IMAGE: IMAGE, pb.MODALITY_VIDEO: VIDEO, pb.MODALITY_AUDIO: AUDIO}


def _modality(item: pb.Item | pb.LookupRequest, index: int | None) -> str:
    """``modality`` as ``RequestItem.modality``; proto3 enums are open, so a number this
    server does not know (a newer client's) is refused naming the item, never read as an image."""
    modality = _MODALITIES.get(item.modality)
    if modality is None:
        known = ", ".join(f"{pb.Modality.Name(n)} ({n})" for n in _MODALITIES)
        raise InvalidRequest(f"modality {item.modality} is not one of {known}", index=index)
    return modality


def _settings(message: Any, index: int | None = None) -> dict[str, Any] | None:
    """A message's ``mm_processor_kwargs_json`` (None: unset or empty): a JSON object, else 400
    ``invalid_setting`` (naming the item, for an item's)."""
    if not message.HasField("mm_processor_kwargs_json") or not message.mm_processor_kwargs_json:
        return None
    try:
        parsed = json.loads(message.mm_processor_kwargs_json)
    except ValueError as exc:
        raise BadInput(f"mm_processor_kwargs_json is not valid JSON: {exc}", type="invalid_setting",
                       index=index) from None
    if not isinstance(parsed, dict):
        raise BadInput(f"mm_processor_kwargs_json must be a JSON object, got {type(parsed).__name__}",
                       type="invalid_setting", index=index)
    return parsed


def _items(raw: Sequence[pb.Item], *, max_items: int, settings: dict[str, Any] | None = None) -> list[RequestItem]:
    """The same item rules as the HTTP body (``frontdoor``), each item's settings over the request's."""
    check_count(len(raw), max_items)
    return [
        request_item(
            index, item.hash if item.HasField("hash") else None, item.data if item.HasField("data") else None,
            _modality(item, index), item_settings(settings, _settings(item, index)),
        )
        for index, item in enumerate(raw)
    ]


def _encode_item(r: ItemResult, return_kind: Return) -> pb.EncodeItem:
    """``item_fields`` as protobuf; the tensor bytes travel raw (no base64) with ``EMBEDDINGS``."""
    fields = item_fields(r, return_kind)
    out = pb.EncodeItem(index=r.index, hash=r.mm_hash, status=r.status)
    if r.source is not None:
        out.source = r.source
    if r.embedding is not None:
        data = r.embedding.tensor.data if return_kind is Return.EMBEDDINGS else b""
        out.num_tokens = fields["num_tokens"]
        out.embedding.CopyFrom(pb.Tensor(dtype=fields["dtype"], shape=fields["shape"], data=data))
        out.meta_json = json.dumps(fields["meta"], separators=(",", ":"))
    if "key" in fields:
        out.key = fields["key"]
    return out


class GrpcApi(pb_grpc.EncoderServicer):
    """``encode_server.v1.Encoder``; every RPC goes through ``_call`` (auth, readiness, errors)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        return await self._call("Encode", self._encode, request, context)

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        return await self._call("Lookup", self._lookup, request, context)

    async def Tokens(self, request: pb.TokensRequest, context: grpc.aio.ServicerContext) -> pb.TokensResponse:
        return await self._call("Tokens", self._tokens, request, context)

    async def Model(self, request: pb.ModelRequest, context: grpc.aio.ServicerContext) -> pb.ModelResponse:
        return await self._call("Model", self._model, request, context)

    # -- the one call site -----------------------------------------------------------------------

    def _authorize(self, context: grpc.aio.ServicerContext, record: RequestRecord) -> str | None:
        """The tenant that keys this call's cache entries (None: shared), as on HTTP."""
        return authorize(self.runtime, dict(context.invocation_metadata() or ()).get("authorization"), record)

    async def _call(
        self,
        name: str,
        handler: Callable[[EncodeService, Req, RequestRecord, str | None], Awaitable[Resp]],
        request: Req,
        context: grpc.aio.ServicerContext,
    ) -> Resp:
        """Auth, readiness, errors and the accounting both doors share (``record_request``): the
        record's ``code`` is the HTTP twin of the gRPC status, and ``sent`` the response message's
        size (an error's status details, as HTTP counts its JSON error body)."""
        metadata = dict(context.invocation_metadata() or ())
        client_id = metadata.get("x-request-id")
        record = RequestRecord(
            protocol="grpc", method="POST", route=f"grpc:{name}",
            request_id=new_request_id(client_id if isinstance(client_id, str) else None),
        )
        context.set_trailing_metadata((("x-request-id", record.request_id),))
        with record_request(self.runtime, record):  # a drain waits for gRPC calls too
            try:
                tenant = self._authorize(context, record)
                check_decoded(request)  # bytes that were not a protobuf: INVALID_ARGUMENT, not UNKNOWN
                try:
                    response = await handler(self.runtime.require_service(), request, record, tenant)
                except asyncio.CancelledError:
                    if not cancelled_by_stop(self.runtime):
                        raise
                    raise shutting_down() from None  # answered below, as every refusal
            except EncodeServerError as exc:
                details = f"{exc.type}: {exc.message}"  # the type leads, for clients that read no metadata
                record.code, record.sent = status_for(exc), len(details.encode())
                await context.abort(
                    code_for(exc), details,
                    trailing_metadata=(*error_metadata(exc), ("x-request-id", record.request_id)),
                )
                raise  # unreachable: abort raises
            except (asyncio.CancelledError, grpc.aio.AbortError):
                record.code = 499
                raise
            except Exception:
                log.exception("unexpected error in gRPC %s", name)
                await context.abort(
                    grpc.StatusCode.INTERNAL, "internal server error",
                    trailing_metadata=(("error-type", "internal"), ("x-request-id", record.request_id)),
                )
                raise
            record.code = 200
            record.sent = response.ByteSize()  # type: ignore[attr-defined]
            return response

    # -- handlers --------------------------------------------------------------------------------

    def _check_size(self, request: Any) -> None:
        limit = self.runtime.settings.max_request_bytes
        size = request.ByteSize()
        if size > limit:
            raise TooLarge(f"request is {size} bytes, above the limit of {limit} (--max-request-bytes)")

    async def _encode(
        self, service: EncodeService, request: pb.EncodeRequest, record: RequestRecord, tenant: str | None
    ) -> pb.EncodeResponse:
        s = self.runtime.settings
        self._check_size(request)
        items = _items(request.items, max_items=s.max_items, settings=_settings(request))
        record.items = len(items)
        record.read_at = time.perf_counter()  # grpc-core received the message; this is its parse
        return_kind = Return.METADATA if request.return_kind == pb.RETURN_METADATA else Return.EMBEDDINGS
        results = await service.encode(items, return_kind=return_kind, tenant=tenant)
        record.resolved_at = time.perf_counter()
        record.hits = sum(r.status == "hit" for r in results)
        served = service.describe()
        return pb.EncodeResponse(
            model=served.model,
            fingerprint=served.fingerprint,
            items=[_encode_item(r, return_kind) for r in results],
        )

    async def _lookup(
        self, service: EncodeService, request: pb.LookupRequest, record: RequestRecord, tenant: str | None
    ) -> pb.LookupResponse:
        check_count(len(request.hashes), self.runtime.settings.max_light_items, "hashes")
        found = await service.lookup(list(request.hashes), tenant=tenant, modality=_modality(request, None),
                                     settings=_settings(request))
        record.items, record.hits = len(found), sum(f.cached for f in found)
        return pb.LookupResponse(
            items=[pb.LookupItem(hash=f.mm_hash, cached=f.cached, tier=f.tier) for f in found]
        )

    async def _tokens(
        self, service: EncodeService, request: pb.TokensRequest, record: RequestRecord, tenant: str | None
    ) -> pb.TokensResponse:
        s = self.runtime.settings
        self._check_size(request)
        settings = _settings(request)
        items = _items(request.items, max_items=s.max_items, settings=settings) if request.items else []
        if request.sizes:
            check_count(len(request.sizes), s.max_light_items, "sizes")
        sizes = [(int(size.width), int(size.height)) for size in request.sizes]
        counts = await service.tokens(items=items, sizes=sizes, settings=settings)
        record.items = len(counts)
        served = service.describe()
        return pb.TokensResponse(
            model=served.model,
            fingerprint=served.fingerprint,
            items=[
                pb.TokenCount(index=c.index, num_tokens=c.num_tokens, width=c.width, height=c.height,
                              meta_json=json.dumps(c.meta, separators=(",", ":")))
                for c in counts
            ],
        )

    async def _model(
        self, service: EncodeService, request: pb.ModelRequest, record: RequestRecord, tenant: str | None
    ) -> pb.ModelResponse:
        served = service.describe()
        info = served.info
        return pb.ModelResponse(
            model=info.model_id, id=info.model_id, fingerprint=served.fingerprint, kind=info.kind, dtype=info.dtype,
            hidden_size=info.hidden_size, json=json.dumps(describe_model(service)),
        )


class HealthApi(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health``: SERVING exactly when ``/ready`` is 200 (loaded, warm, not draining).

    The status is read from the runtime on every call rather than pushed, so it can never go stale;
    ``Watch`` polls it at ``poll_s``. Open, like ``/ready``."""

    SERVICES = frozenset({"", SERVICE_NAME})

    def __init__(self, runtime: Runtime, *, poll_s: float = 0.5) -> None:
        self.runtime = runtime
        self.poll_s = poll_s

    def _status(self) -> int:
        ready = self.runtime.ready
        return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self._status())

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> Any:
        last = None
        while True:
            status = (
                self._status() if request.service in self.SERVICES
                else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self.runtime.draining:
                return  # NOT_SERVING was sent; an open stream must not hold the shutdown up
            await asyncio.sleep(self.poll_s)


async def start_grpc_server(
    runtime: Runtime, extra: Callable[[grpc.aio.Server], None] | None = None
) -> grpc.aio.Server:
    """Bind ``--host``:``--grpc-port`` in the running event loop and start (``encode_server.app``
    calls it beside the HTTP door; neither door starts the other).

    A port that is taken raises ``PortUnavailable`` before anything listens: grpc-core's own
    ``SO_REUSEPORT`` is turned off, or a second server on the port would start and take half
    its connections (``api/ports.py``). Health says NOT_SERVING until the model is ready.
    Messages up to ``--max-request-bytes``; a call's metadata up to ``--max-header-bytes``
    (grpc-core's soft and hard limits both: above it, RESOURCE_EXHAUSTED, every time).
    ``extra`` adds another service (``--sglang``: SGLang's ``SglangEncoder``, ``api/sglang_grpc.py``)."""
    s = runtime.settings
    check_bindable("gRPC", "--grpc-port", s.host, s.grpc_port)  # a clear reason, not grpc-core's log line
    server = grpc.aio.server(
        interceptors=[GrpcBudgetInterceptor(runtime)],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", s.max_request_bytes + _FRAMING_SLACK),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_metadata_size", s.max_header_bytes),
            ("grpc.absolute_max_metadata_size", s.max_header_bytes),
            *GRPC_BUDGET_OPTIONS,
        ]
    )
    add_encoder_servicer(GrpcApi(runtime), server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthApi(runtime), server)
    if extra is not None:
        extra(server)
    host = f"[{s.host}]" if ":" in s.host else s.host
    try:
        server.add_insecure_port(f"{host}:{s.grpc_port}")
    except RuntimeError:  # taken between the check and here
        raise PortUnavailable("gRPC", "--grpc-port", s.host, s.grpc_port, "the address is in use") from None
    await server.start()
    log.info("gRPC listening on %s:%d", host, s.grpc_port)
    return server
