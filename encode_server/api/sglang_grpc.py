"""SGLang's encoder over gRPC (``sglang.grpc.encoder.SglangEncoder``): the same door, called another way.

A prefill started with ``--grpc-mode`` (its receiver ``MMReceiverGrpc``) calls its encoders' ``Encode``
and ``SchedulerReceiveUrl`` over gRPC instead of HTTP; the embeddings still travel over ZMQ. Served on
``--grpc-port`` beside ``encode_server.v1.Encoder`` when ``--sglang`` is on. Each call runs exactly
what the HTTP door runs (:meth:`SglangDoor.run`, :meth:`SglangDoor.register`): the same service,
cache, limits, auth (the ``authorization`` metadata) and metrics (route ``grpc:SglangEncoder/...``).

What differs from HTTP is the protocol's: ``EncodeRequest`` has no modality (SGLang's gRPC path takes
images only); its ``embedding_port`` is a list, empty when the prefill's ranks register their URLs
(``zmq_to_scheduler``), one port for ``zmq_to_tokenizer`` (every port listed gets the part, as SGLang's
own gRPC encoder sends to each); an error is the call's status (``INVALID_ARGUMENT`` for what SGLang
answers 400, ``INTERNAL`` otherwise, as SGLang's encoder sets them) with the message as details.
``Send`` (Mooncake's RDMA transfer) is ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from encode_server.api.frontdoor import RequestRecord, authorize, cancelled_by_stop, new_request_id, record_request
from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2 as pb
from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2_grpc as pb_grpc
from encode_server.api.runtime import shutting_down
from encode_server.api.sglang import Failure, Refused, SglangDoor, parse_encode
from encode_server.api.status import status_for
from encode_server.core.errors import EncodeServerError

__all__ = ["SERVICE_NAME", "SglangGrpc", "add_sglang_servicer"]

SERVICE_NAME = "sglang.grpc.encoder.SglangEncoder"


# SGLang's encoder answers INVALID_ARGUMENT for what it answers 400 over HTTP and INTERNAL otherwise;
# the statuses it never gives keep the codes our own gRPC door gives them (api/grpc.py's CODES).
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class SglangGrpc(pb_grpc.SglangEncoderServicer):
    """SGLang's encoder service over an :class:`SglangDoor`."""

    def __init__(self, door: SglangDoor) -> None:
        self.door = door
        self.runtime = door.runtime

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        with self._record("Encode", context) as record:
            failure = await self._encode(request, context, record)
            if failure is not None:
                await self._fail(context, record, failure)
            record.code = 200
            return pb.EncodeResponse()

    async def SchedulerReceiveUrl(
        self, request: pb.SchedulerReceiveUrlRequest, context: grpc.aio.ServicerContext
    ) -> pb.SchedulerReceiveUrlResponse:
        with self._record("SchedulerReceiveUrl", context) as record:
            try:
                self._authorize(context, record)
                self.door.register(request.req_id, request.receive_url, request.receive_count)
            except ValueError as exc:
                await self._fail(context, record, Failure(400, str(exc)))
            except EncodeServerError as exc:
                await self._fail(context, record, Failure(status_for(exc), exc.message, exc.type))
            record.code = 200
            return pb.SchedulerReceiveUrlResponse()

    async def Send(self, request: pb.SendRequest, context: grpc.aio.ServicerContext) -> pb.SendResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "encode-server sends over ZMQ only: the mooncake backend is not served")
        raise AssertionError("unreachable: abort raises")

    # -- steps ---------------------------------------------------------------------------------------

    def _record(self, name: str, context: grpc.aio.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        client_id = metadata.get("x-request-id")
        record = RequestRecord(protocol="grpc", method="POST", route=f"grpc:SglangEncoder/{name}",
                               request_id=new_request_id(client_id if isinstance(client_id, str) else None))
        return record_request(self.runtime, record)

    def _authorize(self, context: grpc.aio.ServicerContext, record: RequestRecord) -> str | None:
        return authorize(self.runtime, dict(context.invocation_metadata() or ()).get("authorization"), record)

    async def _encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext,
                      record: RequestRecord) -> Failure | None:
        body = {"req_id": request.req_id, "mm_items": list(request.mm_items), "modality": "IMAGE",
                "num_parts": request.num_parts, "part_idx": request.part_idx,
                "prefill_host": request.prefill_host or None,
                "embedding_port": list(request.embedding_port) or None}
        hold = self.runtime.budget.hold()  # what fetching and decoding the items hold, as an upload's body
        try:
            tenant = self._authorize(context, record)
            service = self.runtime.require_service()
            part = parse_encode(body)
            return await self.door.run(part, service, tenant, hold, record)
        except Refused as exc:
            return Failure(400, str(exc))
        except EncodeServerError as exc:
            return Failure(status_for(exc), exc.message, exc.type, None)
        except asyncio.CancelledError:
            if not cancelled_by_stop(self.runtime):
                raise
            error = shutting_down()
            return Failure(503, error.message, error.type)
        finally:
            hold.release()

    async def _fail(self, context: grpc.aio.ServicerContext, record: RequestRecord, failure: Failure) -> None:
        record.code = failure.status
        record.sent = len(failure.message.encode())
        code = _CODES.get(failure.status, grpc.StatusCode.INTERNAL)
        metadata = (("error-type", failure.type),) if failure.type else ()
        await context.abort(code, failure.message, trailing_metadata=(*metadata, ("x-request-id", record.request_id)))


def add_sglang_servicer(door: SglangDoor, server: grpc.aio.Server) -> None:
    """SGLang's encoder service on the gRPC server ``start_grpc_server`` builds."""
    pb_grpc.add_SglangEncoderServicer_to_server(SglangGrpc(door), server)
