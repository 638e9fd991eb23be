"""The gRPC wire: messages to build and answers to parse, and gRPC errors in the HTTP API's
terms (status, ``type``, ``index``). ``grpcio`` is an optional extra (``encode-client[grpc]``),
imported only when a ``grpc://`` replica is used."""

from __future__ import annotations

import json
from typing import Any

import grpc

from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client._images import AUDIO, VIDEO, WireItem
from encode_client._proto import encoder_pb2 as pb
from encode_client._types import LookupItem, Result, TokenCount

__all__ = ["METHODS", "build", "error", "parse"]

METHODS = {"encode": "Encode", "handoff": "Encode", "lookup": "Lookup", "tokens": "Tokens", "model": "Model"}

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_BY_TYPE = {"invalid_request": 422, "unsupported_media_type": 415, "unsupported_video": 415, "unsupported_audio": 415}


_MODALITIES = {VIDEO: pb.MODALITY_VIDEO, AUDIO: pb.MODALITY_AUDIO}  # an image is the default, unset


def _item(wire: WireItem) -> Any:
    item = pb.Item()
    if wire.hash is not None:
        item.hash = wire.hash
    if wire.data is not None:
        item.data = wire.data
    if wire.modality in _MODALITIES:
        item.modality = _MODALITIES[wire.modality]
    if wire.settings:
        item.mm_processor_kwargs_json = json.dumps(dict(wire.settings))
    return item



def build(op: str, payload: Any) -> Any:
    if op == "encode":
        return pb.EncodeRequest(items=[_item(item) for item in payload])
    if op == "handoff":
        return pb.EncodeRequest(items=[_item(item) for item in payload], return_kind=pb.RETURN_METADATA)
    if op == "lookup":
        modality, hashes, settings = payload
        kind = _MODALITIES.get(modality, pb.MODALITY_IMAGE)
        lookup = pb.LookupRequest(hashes=list(hashes), modality=kind)
        if settings:
            lookup.mm_processor_kwargs_json = json.dumps(dict(settings))
        return lookup
    if op == "tokens":
        kind, entries, settings = payload
        if kind == "sizes":
            request = pb.TokensRequest(sizes=[pb.Size(width=w, height=h) for w, h in entries])
            if settings:
                request.mm_processor_kwargs_json = json.dumps(dict(settings))
            return request
        return pb.TokensRequest(items=[_item(item) for item in entries])
    if op == "model":
        return pb.ModelRequest()
    raise ValueError(f"unknown operation {op!r}")


def parse(op: str, response: Any, replica: str) -> list[Any]:
    if op in ("encode", "handoff"):
        return [
            Result(
                index=i.index,
                hash=i.hash,
                status=i.status,
                source=i.source if i.HasField("source") else None,
                num_tokens=i.num_tokens if i.HasField("embedding") else None,
                shape=tuple(i.embedding.shape),
                dtype=i.embedding.dtype or None,
                meta=json.loads(i.meta_json) if i.meta_json else {},
                data=i.embedding.data,
                replica=replica,
                key=i.key if i.HasField("key") else None,
                model=response.model or None,
                fingerprint=response.fingerprint or None,
            )
            for i in response.items
        ]
    if op == "lookup":
        return [LookupItem(i.hash, i.cached, i.tier if i.HasField("tier") else None) for i in response.items]
    if op == "tokens":
        return [
            TokenCount(i.index, i.num_tokens, i.width, i.height, json.loads(i.meta_json) if i.meta_json else {})
            for i in response.items
        ]
    return [json.loads(response.json)]


def error(exc: grpc.RpcError, replica: str) -> Exception:
    """An ``RpcError`` as a ``ServerError`` (the server answered) or ``ReplicaUnavailable``."""
    code = exc.code()
    md = {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
    kind = md.get("error-type")
    if kind is None:
        if code == grpc.StatusCode.UNAVAILABLE:  # no answer from a servicer: the channel failed
            return ReplicaUnavailable(replica, exc.details() or "unavailable")
        kind = {
            grpc.StatusCode.RESOURCE_EXHAUSTED: "payload_too_large",  # grpc's own message-size limit
            grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
        }.get(code, code.name.lower())
    status = _BY_TYPE.get(kind) or _HTTP_STATUS.get(code, 500)
    index = int(md["error-index"]) if md.get("error-index", "").isdigit() else None
    retry_after = float(md["retry-after"]) if "retry-after" in md else None
    message = (exc.details() or "").removeprefix(f"{kind}: ")  # the server leads details with the type
    return ServerError(status, kind, message, index, retry_after=retry_after, replica=replica)
