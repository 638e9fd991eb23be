"""The request-memory budget at both front doors: refuse before holding, not after.

HTTP (:class:`BodyBudgetMiddleware`, pure ASGI): a declared ``Content-Length`` is charged before
a byte of the body is read, and a request it does not fit is answered at once, 503 ``overloaded``
with ``Retry-After``, its body never read, and the connection closed rather than drained. A
chunked (undeclared) body is charged as it arrives and refused the moment it would overflow (its
connection closed too). Bytes beyond a declared length are never body: the HTTP parser reads
them as the next request. The request's :class:`Hold` lives
in the ASGI scope's state, where the body parsers (``api/bodies.py``) settle it to what they
still hold once the body is parsed (decoded base64, multipart parts); it is released when a
successful response starts (the route has returned: it holds nothing of the request), or once
an error response has been sent (until then the exception's traceback holds the route's frames).

gRPC (:class:`GrpcBudgetInterceptor`): gRPC receives a whole message before any handler runs, and
its size is unknown until then. So a call reserves what receiving one largest message
(``--max-request-bytes``) takes when it starts (four copies at the peak, measured), and is refused
at once, without its message being received, when that does not fit; once the message has
arrived the reservation is settled to what the call really holds (the message and its items).
``Lookup`` and ``Model``, whose messages hold hashes or nothing, reserve a 1 MiB message only.

Every refusal is counted in ``rejected_total{reason="memory"}``.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from encode_server.api.runtime import Runtime
from encode_server.config import MESSAGE_FRAMING, REQUEST_COPIES
from encode_server.core.budget import Hold, OverBudget
from encode_server.core.errors import Unavailable
from encode_server.metrics import Metrics

__all__ = [
    "GRPC_BUDGET_OPTIONS",
    "HOLD_KEY",
    "LIGHT_MESSAGE_BYTES",
    "LIGHT_METHODS",
    "RETRY_AFTER_S",
    "BodyBudgetMiddleware",
    "GrpcBudgetInterceptor",
    "body_hold",
    "over_budget",
]

HOLD_KEY = "body_hold"
# Without BDP probing, gRPC's HTTP/2 flow control keeps a stream's window small until its message
# is asked for (then it opens to the message's size): streams the budget has not admitted, or
# has refused, cannot park whole messages in the transport. Measured: the gRPC burst's peak went
# from the budget + 105 MiB to the budget + 50 MiB.
GRPC_BUDGET_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.http2.bdp_probe", 0),)
# gRPC methods whose messages are hashes or nothing (1024 hashes are about 70 KB).
LIGHT_METHODS = frozenset({"Lookup", "Model"})
LIGHT_MESSAGE_BYTES = 1024 * 1024
RETRY_AFTER_S = 1
_MIB = 1024 * 1024


def body_hold(scope: Scope) -> Hold | None:
    """The budget hold of this HTTP request (None outside the middleware, e.g. in unit tests)."""
    state = scope.get("state")
    hold = state.get(HOLD_KEY) if isinstance(state, dict) else None
    return hold if isinstance(hold, Hold) else None


def over_budget(metrics: Metrics, exc: OverBudget, *, before_body: bool = False) -> Unavailable:
    """The 503 a memory refusal answers, counted once here."""
    metrics.reject("memory")
    capacity = f"{exc.capacity / _MIB:.0f} MiB" if exc.capacity is not None else "unbounded"
    when = "; the body was not read" if before_body else ""
    return Unavailable(
        f"request memory budget is full ({exc.asked / _MIB:.1f} MiB asked, {exc.available / _MIB:.1f} MiB "
        f"of {capacity} free{when}); retry later",
        type="overloaded",
        retry_after=RETRY_AFTER_S,
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _error_messages(exc: Unavailable, *, close: bool) -> tuple[Message, Message]:
    body = json.dumps({"error": {"type": exc.type, "message": exc.message, "index": exc.index}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(max(1, round(exc.retry_after))).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    start = {"type": "http.response.start", "status": 503, "headers": headers}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class BodyBudgetMiddleware:
    """Charge every HTTP request's body to the runtime's budget before it is held (module doc)."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        budget = self.runtime.budget
        metrics = self.runtime.metrics
        hold = budget.hold()
        scope.setdefault("state", {})[HOLD_KEY] = hold
        declared = _content_length(scope)
        limit = self.runtime.settings.max_request_bytes
        # Above --max-request-bytes the route answers 413 before reading: nothing to charge.
        prepaid = declared if declared is not None and declared <= limit else 0
        if prepaid and not hold.grow(prepaid):
            error = over_budget(metrics, OverBudget(prepaid, budget.available or 0, budget.capacity), before_body=True)
            hold.release()
            # Closed, not drained: reading a refused body only to drop it slows every other
            # refusal behind it (clients still get the answer: it is written before the close).
            for message in _error_messages(error, close=True):
                await send(message)
            return

        received = 0
        body_done = declared == 0 or scope.get("method") in ("GET", "HEAD")
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, body_done, refused
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                unpaid = max(0, received + size - max(prepaid, received))
                received += size
                body_done = not message.get("more_body", False)
                if unpaid and not hold.grow(unpaid):
                    refused = True
                    raise OverBudget(unpaid, budget.available or 0, budget.capacity)
            return message

        started = False

        async def releasing_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] < 400:
                    # The route has returned: nothing of the request is held any more. An error
                    # response is sent while the exception's traceback still holds the request's
                    # frames (and bytes): that hold ends with the call, below.
                    hold.release()
                if not body_done and (refused or declared is None or declared > limit):
                    # A body still streaming in that nobody will read: close, don't drain it.
                    message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        try:
            await self.app(scope, counting_receive, releasing_send)
        except OverBudget as exc:
            if started:
                raise
            error = over_budget(metrics, exc)
            refused = True
            for message in _error_messages(error, close=not body_done):
                await releasing_send(message)
        finally:
            hold.release()


class GrpcBudgetInterceptor(grpc.aio.ServerInterceptor):
    """Reserve, per unary call of ``service``, what receiving its message takes, before it is received."""

    def __init__(self, runtime: Runtime, *, service: str = "encode_server.v1.Encoder") -> None:
        self.runtime = runtime
        self.prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        if (
            handler is None
            or not method.startswith(self.prefix)
            or handler.request_streaming
            or handler.response_streaming
            or handler.unary_unary is None
        ):
            return handler
        name = method[len(self.prefix):]
        budget = self.runtime.budget
        hold = budget.hold()
        # Receiving and parsing a message holds it up to four times at once (gRPC's buffer, the
        # bytes handed to the parser, the parsed message, the items' copies of its image bytes).
        # Lookup and Model carry no image bytes: they reserve a light message, so that a router's
        # lookups are not refused for room that uploads need (a larger one is charged on arrival).
        largest = LIGHT_MESSAGE_BYTES if name in LIGHT_METHODS else self.runtime.settings.max_request_bytes
        reserve = REQUEST_COPIES * (min(largest, self.runtime.settings.max_request_bytes) + MESSAGE_FRAMING)
        if not hold.grow(reserve):
            return self._refusal(name, handler, OverBudget(reserve, budget.available or 0, budget.capacity))
        unary = handler.unary_unary

        # A client-streaming handler (the same bytes on the wire as a unary call) receives the
        # message only when we ask for it, so the reservation is in place before it arrives and
        # the ``finally`` releases it on every path, a cancelled receive included.
        async def behaviour(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                messages = aiter(requests)
                request: Any = await anext(messages, None)
                # Close the receiver now: suspended after its first message, its frame would
                # hold the message's raw bytes for as long as the call lives, and longer.
                if (close := getattr(messages, "aclose", None)) is not None:
                    await close()
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid_request: no request message")
                # From now on: the message, and the copies of its image bytes that the items hold.
                holds = 2 * request.ByteSize()
                if not hold.settle(holds):
                    exc = OverBudget(holds - hold.held, budget.available or 0, budget.capacity)
                    await self._abort(name, context, over_budget(self.runtime.metrics, exc))
                return await unary(request, context)
            except BaseException as exc:
                _clear_frames(exc)
                raise
            finally:
                request = None  # this frame may outlive the call in a traceback: not the bytes
                hold.release()

        return grpc.stream_unary_rpc_method_handler(
            behaviour,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _refusal(self, name: str, handler: grpc.RpcMethodHandler, exc: OverBudget) -> grpc.RpcMethodHandler:
        error = over_budget(self.runtime.metrics, exc)

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._abort(name, context, error)  # the message is never received

        return grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    async def _abort(self, name: str, context: grpc.aio.ServicerContext, error: Unavailable) -> None:
        metrics = self.runtime.metrics
        route = f"grpc:{name}"
        metrics.requests.labels(route=route, code="503").inc()  # as GrpcApi labels its 503s
        metrics.request_seconds.labels(route=route).observe(0.0)
        retry = str(max(1, round(error.retry_after)))
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{error.type}: {error.message}",
            trailing_metadata=(("error-type", error.type), ("retry-after", retry)),
        )



def _clear_frames(exc: BaseException | None) -> None:
    """Drop the locals of the finished frames an error (and the errors it chains) holds.

    gRPC's error path keeps the abort exception, whose context is the domain error, whose
    traceback holds the handler's frames, the request message and its image bytes among their
    locals, in reference cycles only the garbage collector frees: memory the budget no longer
    counts. The line numbers stay for logging; only the locals go."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
