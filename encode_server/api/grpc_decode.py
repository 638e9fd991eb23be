"""Request decoding for the gRPC front door that never turns bad bytes into UNKNOWN.

With the generated ``add_EncoderServicer_to_server``, a request that is not a valid protobuf of
its type (a wrong field number, truncated varint, invalid UTF-8 in a string) fails inside grpc's
own deserializer, and the client gets ``UNKNOWN`` with no error type: an undocumented code for
what is plainly bad input. Here the deserializer never raises: it hands the servicer an
:class:`Undecodable`, which the servicer turns into ``INVALID_ARGUMENT`` / ``invalid_request``
after authentication, counted and logged like any other bad request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.core.errors import InvalidRequest

__all__ = ["Undecodable", "add_encoder_servicer", "check_decoded"]

SERVICE = "encode_server.v1.Encoder"
_METHODS: dict[str, tuple[type[Any], type[Any]]] = {
    "Encode": (pb.EncodeRequest, pb.EncodeResponse),
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "Tokens": (pb.TokensRequest, pb.TokensResponse),
    "Model": (pb.ModelRequest, pb.ModelResponse),
}


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes are not a ``message`` protobuf."""

    message: str
    reason: str
    size: int

    def ByteSize(self) -> int:
        """The size of the bytes that did not decode (the request-memory budget charges it)."""
        return self.size


def _tolerant(message: type[Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except (DecodeError, ValueError, RecursionError) as exc:
            return Undecodable(message.__name__, str(exc) or type(exc).__name__, len(raw))

    return deserialize


def check_decoded(request: object) -> None:
    """Raise ``InvalidRequest`` (INVALID_ARGUMENT) for a request that did not decode."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(
            f"the {request.size}-byte request is not a valid {request.message} protobuf: {request.reason}"
        )


def add_encoder_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """``add_EncoderServicer_to_server`` with decoding that can't fail (see the module doc)."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_tolerant(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in _METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
