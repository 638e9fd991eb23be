"""The fast path for small hash-only hits over HTTP: ``POST /v1/encode`` asking for safetensors
with a small JSON body of hashes only, every one in the local tier.

That request is what a prefill worker or the EPD proxy sends for a repeated image, and most of its
time in the server went to the layers around the answer, not to the answer: Starlette's request
object, three middlewares' wrapped ``receive``/``send``, pydantic validation, the service's
timeout and tier walk (about 130 us of a 64-token hit's 170 us in-process, quiet). This class
answers it in one ASGI call and otherwise changes nothing observable:

- it runs outside the other middlewares and takes a request only when it can answer it whole:
  the route, method, media types and a declared body under :data:`SMALL_BODY` bytes; the server
  ready; the API key (when keys are set) valid; the body's bytes within the request budget; the
  body exactly ``{"items": [{"hash": ...}, ...]}`` (``"return": "embeddings"`` allowed) within
  ``--max-items``; every hash well formed and a local hit (``EncodeService.local_hits``);
- anything else, every error included, goes to the full stack with the body it read replayed,
  and is answered, counted and logged there as before (nothing is counted twice: this path counts
  nothing until it answers);
- the answer is the full path's byte for byte (headers, ``X-Request-ID``, the safetensors parts of
  ``safetensors_answer``), and it is accounted by the same ``record_request`` (metrics, the
  access-log line, the in-flight count a drain waits on), its body charged to the budget until
  the answer starts, as the budget middleware does.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from encode_server.api.frontdoor import RequestRecord, new_request_id, record_request
from encode_server.api.runtime import Runtime
from encode_server.core.errors import EncodeServerError
from encode_server.core.types import ItemResult
from encode_server.service import EncodeService

__all__ = ["SMALL_BODY", "SmallHitPath"]

SMALL_BODY = 64 * 1024  # 900 hashes; a larger body is an upload, whose cost is not the layers
_SAFETENSORS = b"application/vnd.safetensors"
# A small answer goes out in one write: the header apart is one more loopback segment and one more
# wake-up of the reader (measured: 3 socket writes a hit against the raw wire's 2), which costs
# more than copying up to this many bytes.
_JOIN_BELOW = 1 << 20


class SmallHitPath:
    """Small hash-only safetensors hits answered in one call; every other request to ``app``
    untouched (module doc). ``render`` is the full path's safetensors answer (``http.py``)."""

    def __init__(
        self, app: ASGIApp, runtime: Runtime, render: Callable[[EncodeService, list[ItemResult]], list[bytes]]
    ) -> None:
        self.app = app
        self.runtime = runtime
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/encode" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        started = perf_counter()
        declared = accept = authorization = client_id = None
        json_body = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"content-type":
                json_body = value.split(b";", 1)[0].strip().lower() == b"application/json"
            elif name == b"accept":
                accept = value
            elif name == b"authorization":
                authorization = value
            elif name == b"x-request-id":
                client_id = value
        runtime = self.runtime
        service = runtime.service
        if (
            not json_body
            or accept is None
            or _SAFETENSORS not in accept
            or declared is None
            or not declared.isdigit()
            or (size := int(declared)) > SMALL_BODY
            or service is None
            or runtime.draining
        ):
            await self.app(scope, receive, send)
            return
        tenant = None
        if runtime.keys is not None:
            try:
                tenant = runtime.keys.authenticate(authorization.decode("latin-1") if authorization else None)
            except EncodeServerError:
                await self.app(scope, receive, send)  # answered and counted there
                return
        budget = runtime.budget
        if not budget.try_acquire(size):
            await self.app(scope, receive, send)  # refused there, with its 503
            return
        charged = size
        try:
            message = await receive()
            hashes = _hashes(message, size, runtime.settings.max_items)
            results = (
                service.local_hits(hashes, tenant=runtime.cache_tenant(tenant)) if hashes is not None else None
            )
            if results is None:
                budget.release(charged)
                charged = 0
                await self.app(scope, _replay(message, receive), send)
                return
            record = RequestRecord(
                protocol="http", method="POST", route="/v1/encode",
                request_id=new_request_id(client_id.decode("latin-1") if client_id is not None else None),
                started=started,
            )
            with record_request(runtime, record):
                record.tenant, record.items, record.hits = tenant, len(results), len(results)
                parts = self.render(service, results)
                length = sum(len(p) for p in parts)
                headers = [
                    (b"content-length", str(length).encode()),
                    (b"content-type", _SAFETENSORS),
                    (b"x-request-id", record.request_id.encode()),
                ]
                budget.release(charged)  # the answer holds none of the request's bytes
                charged = 0
                record.code = 200
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                if length <= _JOIN_BELOW:
                    parts = [b"".join(parts)]
                last = len(parts) - 1
                for i, part in enumerate(parts):
                    record.sent += len(part)
                    await send({"type": "http.response.body", "body": part, "more_body": i < last})
        finally:
            if charged:
                budget.release(charged)


def _hashes(message: Message, size: int, max_items: int) -> list[Any] | None:
    """The hashes of a body that is exactly ``{"items": [{"hash": h}, ...]}`` (optionally with
    ``"return": "embeddings"``), all of it in ``message``; None for anything else."""
    if message["type"] != "http.request" or message.get("more_body", False):
        return None
    body = message.get("body", b"")
    if len(body) != size:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or (len(obj) != 1 and (len(obj) != 2 or obj.get("return") != "embeddings")):
        return None
    items = obj.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= max_items:
        return None
    hashes = []
    for item in items:
        if not isinstance(item, dict) or len(item) != 1 or (h := item.get("hash")) is None:
            return None
        hashes.append(h)
    return hashes


def _replay(first: Message, receive: Receive) -> Receive:
    """``receive`` that hands out ``first`` (already read) once, then the connection's own."""
    pending: list[Message] = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
