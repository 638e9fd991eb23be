"""What the HTTP and gRPC front doors share, written once so that they cannot drift.

- item rules: how many items a request may hold and what each must carry;
- per-request accounting: ``requests_total``, ``request_seconds``, ``inflight_requests``,
  ``response_bytes_total``, the in-flight count a drain waits on, and the one access-log line;
- a stop at once (``Runtime.stop_now``): telling its cancellation from any other, so that a
  door answers it 503 instead of dying with it;
- ``Retry-After``: the seconds a refused client should wait, as a header or as metadata;
- result rendering: the fields of one resolved item, before either door's own encoding of them
  (JSON with base64, safetensors, or protobuf).

A door only parses its wire into these calls and renders what they return.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from encode_server.api.runtime import Runtime
from encode_server.core.errors import InvalidRequest, TooLarge, Unavailable
from encode_server.core.types import IMAGE, MODALITIES, ItemResult, RequestItem, Return
from encode_server.logs import ACCESS_LOGGER

__all__ = [
    "RequestRecord",
    "authorize",
    "cancelled_by_stop",
    "check_count",
    "item_fields",
    "item_settings",
    "new_request_id",
    "record_request",
    "request_item",
    "retry_after",
]

access_log = logging.getLogger(ACCESS_LOGGER)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Probes and scrapes go to debug (every few seconds, they would drown the rest) unless they fail;
# /ready's 503 while loading or draining is expected, so it is always quiet.
_QUIET_WHEN_OK = frozenset({"/health", "/metrics"})
_ALWAYS_QUIET = frozenset({"/ready"})


# -- item rules ------------------------------------------------------------------------------------


def check_count(count: int, limit: int, what: str = "items") -> None:
    """At least one and at most ``limit`` entries of ``what`` (items: ``--max-items``; hashes and
    sizes, which carry no image bytes: ``Settings.max_light_items``)."""
    if count > limit:
        flag = "--max-items" if what == "items" else "max(1024, --max-items)"
        raise TooLarge(f"{count} {what} in one request, above the limit of {limit} ({flag})", type="too_many_items")
    if count == 0:
        raise InvalidRequest(f"{what}: at least one is required")


def request_item(
    index: int,
    mm_hash: str | None,
    data: bytes | None,
    modality: str = IMAGE,
    settings: dict[str, Any] | None = None,
) -> RequestItem:
    """One item: its bytes, its hash, or both (the service checks that they agree); an image or a
    video; with the processor settings the request gave it (the service checks them)."""
    if mm_hash is None and data is None:
        raise InvalidRequest("an item needs 'data', 'hash' or both", index=index)
    if modality not in MODALITIES:
        raise InvalidRequest(f"modality must be one of {', '.join(MODALITIES)}, not {modality!r}", index=index)
    return RequestItem(index=index, mm_hash=mm_hash, data=data, modality=modality, settings=settings or None)


def item_settings(request: dict[str, Any] | None, item: dict[str, Any] | None) -> dict[str, Any] | None:
    """An item's settings: the request's ``mm_processor_kwargs`` (its default for every item) with
    the item's own over them, key by key; None when neither gives any."""
    merged = {**(request or {}), **(item or {})}
    return merged or None


# -- a stop at once ------------------------------------------------------------------------------


def cancelled_by_stop(runtime: Runtime) -> bool:
    """Whether the ``CancelledError`` being handled is ``Runtime.stop_now``'s. If so it is taken
    back (Python 3.11+ counts cancellations), so the door's own answer can still be sent: the
    door then answers ``runtime.shutting_down()``; any other cancellation it re-raises."""
    if not runtime.stopping:
        return False
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()
    return True


# -- Retry-After -----------------------------------------------------------------------------------


def retry_after(exc: Exception) -> str | None:
    """Whole seconds (at least 1) a client refused with ``exc`` should wait, or None."""
    if isinstance(exc, Unavailable):
        return str(max(1, round(exc.retry_after)))
    return None


# -- result rendering ------------------------------------------------------------------------------


def item_fields(r: ItemResult, return_kind: Return) -> dict[str, Any]:
    """The fields of one resolved item, without its tensor bytes: every door renders these.

    ``num_tokens``, ``shape``, ``dtype`` and ``meta`` are there for every resolved item; with
    ``Return.METADATA`` so is ``key``, the store key a prefill worker reads the embedding with. A
    miss has none of them: nothing is stored under its key, so it is not handed out."""
    out: dict[str, Any] = {"index": r.index, "hash": r.mm_hash, "status": r.status, "source": r.source}
    if r.embedding is not None:
        t = r.embedding.tensor
        out.update(num_tokens=r.embedding.num_tokens, shape=list(t.shape), dtype=t.dtype, meta=r.embedding.meta)
        if return_kind is Return.METADATA and r.key is not None:
            out["key"] = str(r.key)
    return out


# -- per-request accounting ------------------------------------------------------------------------


def new_request_id(client_value: str | None) -> str:
    """The client's ``X-Request-ID`` when it is a plain token (safe in a log line), else a new one."""
    if client_value is not None and _REQUEST_ID.fullmatch(client_value):
        return client_value
    return os.urandom(16).hex()  # what uuid4().hex carries (random 128 bits), at a third of the cost


@dataclass
class RequestRecord:
    """One request through either door: what its access-log line and its metrics say.

    The door sets ``code`` (an HTTP status; gRPC uses its HTTP twin, so ``requests_total{code}``
    means the same on both doors, and one error-ratio alert covers both) and ``sent`` (response
    body bytes); a route sets ``items``, ``hits`` and ``tenant``. The log line holds no header
    but the request id: an API key can never reach it."""

    protocol: str  # "http" | "grpc"
    method: str
    route: str
    request_id: str
    code: int = 500
    sent: int = 0
    items: int = 0
    hits: int = 0
    tenant: str | None = None
    started: float = field(default_factory=time.perf_counter)
    # An encode's stage timers (``stage_seconds``), set by its route: body read, every item resolved.
    read_at: float | None = None
    resolved_at: float | None = None

    def fields(self, elapsed: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "protocol": self.protocol, "method": self.method,
            "route": self.route, "code": self.code, "items": self.items, "hits": self.hits,
            "bytes": self.sent, "duration_ms": round(elapsed * 1000, 2), "tenant": self.tenant,
        }


def authorize(runtime: Runtime, authorization: object, record: RequestRecord) -> str | None:
    """A request's ``Authorization`` (an HTTP header or gRPC metadata: anything but a string is none)
    checked (``Unauthorized``), its tenant on ``record``; the tenant that keys its cache entries
    (None: shared). Every door's routes authenticate through here."""
    tenant = runtime.authenticate(authorization if isinstance(authorization, str) else None)
    record.tenant = tenant
    return runtime.cache_tenant(tenant)


@contextmanager
def record_request(runtime: Runtime, record: RequestRecord) -> Iterator[RequestRecord]:
    """Account for one request for as long as the block runs, then log it once, whatever the
    outcome. A drain waits for the block (``Runtime.serving``)."""
    metrics = runtime.metrics
    metrics.inflight_requests.inc()
    try:
        with runtime.serving():
            yield record
    finally:
        ended = time.perf_counter()
        elapsed = ended - record.started
        metrics.inflight_requests.dec()
        if record.read_at is not None:
            metrics.stage_read.observe(record.read_at - record.started)
        if record.resolved_at is not None:
            metrics.stage_respond.observe(ended - record.resolved_at)
        metrics.request_done(record.route, record.code, elapsed, record.sent)
        quiet = record.route in _ALWAYS_QUIET or (record.route in _QUIET_WHEN_OK and record.code < 400)
        access_log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s %s %d items=%d hits=%d %.1fms id=%s",
            record.method, record.route, record.code, record.items, record.hits, elapsed * 1000,
            record.request_id, extra={"fields": record.fields(elapsed)},
        )
