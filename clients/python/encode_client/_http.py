"""The HTTP wire: requests to build and answers to parse for each operation. No I/O here; the
sync and async clients send what ``build`` returns with httpx and hand the answer to ``parse``."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from encode_client._errors import ServerError
from encode_client._images import IMAGE, WireItem
from encode_client._types import LookupItem, Result, TokenCount
from encode_client.safetensors import load_safetensors

__all__ = ["SAFETENSORS", "HttpRequest", "build", "parse"]

SAFETENSORS = "application/vnd.safetensors"


@dataclass(frozen=True)
class HttpRequest:
    """One request; at most one of ``json``, ``content`` (a raw body) and ``files`` (multipart)."""

    method: str
    url: str
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None


def _item(item: WireItem) -> dict[str, Any]:
    """A JSON item; ``"modality"`` only for a video or audio and ``"mm_processor_kwargs"`` only with
    settings, so an image's item is what it always was."""
    out: dict[str, Any] = {}
    if item.hash is not None:
        out["hash"] = item.hash
    if item.data is not None:
        out["data"] = base64.b64encode(item.data).decode("ascii")
    if item.modality != IMAGE:
        out["modality"] = item.modality
    if item.settings:
        out["mm_processor_kwargs"] = dict(item.settings)
    return out


def _with_settings(body: dict[str, Any], settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """``body`` with the request's ``mm_processor_kwargs`` when there are any (else as it always was)."""
    return {**body, "mm_processor_kwargs": dict(settings)} if settings else body


def _upload(url: str, items: list[WireItem], headers: dict[str, str]) -> HttpRequest:
    """File bytes as they are, never base64 in JSON (a third bigger, and decoded on the server):
    one file is the whole body, several are the files of a multipart body. A video's body or part
    is ``video/*``, which is how the server tells it from an image."""
    if len(items) == 1:
        (one,) = items
        return HttpRequest("POST", url, headers={**headers, "Content-Type": one.content_type}, content=one.data)
    files = [("file", (f"{i}", item.data or b"", item.content_type)) for i, item in enumerate(items)]
    return HttpRequest("POST", url, headers=headers, files=files)


def build(base_url: str, op: str, payload: Any, *, response: str, api_key: str | None) -> HttpRequest:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    if op == "encode":
        headers["Accept"] = SAFETENSORS if response == "safetensors" else "application/json"
        # An upload body (raw or multipart) carries no settings: items with them go as JSON.
        if payload and all(item.data is not None and not item.settings for item in payload):
            return _upload(base + "/v1/encode", list(payload), headers)
        return HttpRequest("POST", base + "/v1/encode", {"items": [_item(item) for item in payload]}, headers)
    if op == "handoff":  # the EPD hand-off: into the shared tier, metadata and keys back
        handoff = {"items": [_item(item) for item in payload], "return": "metadata"}
        return HttpRequest("POST", base + "/v1/encode", handoff, {**headers, "Accept": "application/json"})
    if op == "lookup":
        modality, hashes, settings = payload  # "modality" only for a video or audio: an image's body is as it was
        lookup = {"hashes": list(hashes), **({"modality": modality} if modality != IMAGE else {})}
        return HttpRequest("POST", base + "/v1/lookup", _with_settings(lookup, settings), headers)
    if op == "tokens":
        kind, entries, settings = payload
        body: dict[str, Any] = (
            {"sizes": [list(s) for s in entries]} if kind == "sizes" else {"items": [_item(item) for item in entries]}
        )
        return HttpRequest("POST", base + "/v1/tokens", _with_settings(body, settings if kind == "sizes" else None),
                           headers)
    if op == "model":
        return HttpRequest("GET", base + "/v1/model", None, headers)
    raise ValueError(f"unknown operation {op!r}")


def _error(status: int, headers: Mapping[str, str], content: bytes, replica: str) -> ServerError:
    try:
        err = json.loads(content)["error"]
        kind, message, index = str(err["type"]), str(err["message"]), err.get("index")
    except (ValueError, KeyError, TypeError):
        kind, message, index = "http_error", content[:200].decode("utf-8", "replace"), None
    retry_after = None
    raw = headers.get("retry-after")
    if raw is not None:
        try:
            retry_after = float(raw)
        except ValueError:
            retry_after = None
    return ServerError(status, kind, message, index, retry_after=retry_after, replica=replica)


def parse(op: str, status: int, headers: Mapping[str, str], content: bytes, replica: str) -> list[Any]:
    """The answer as a list aligned with the request's items (``model``: a one-item list)."""
    if status != 200:
        raise _error(status, headers, content, replica)
    if op in ("encode", "handoff"):
        if headers.get("content-type", "").startswith(SAFETENSORS):
            return _encode_safetensors(content, replica)
        body = json.loads(content)
        return [_result(item, base64.b64decode(item.get("embedding", "")), replica, body) for item in body["items"]]
    body = json.loads(content)
    if op == "lookup":
        return [LookupItem(i["hash"], i["cached"], i["tier"]) for i in body["items"]]
    if op == "tokens":
        return [
            TokenCount(i["index"], i["num_tokens"], i["width"], i["height"], i.get("meta", {})) for i in body["items"]
        ]
    return [body]


def _result(item: Mapping[str, Any], data: bytes, replica: str, answer: Mapping[str, Any]) -> Result:
    """One item of an encode answer; ``answer`` (the JSON body, or the safetensors metadata)
    names the model and fingerprint."""
    shape = item.get("shape")
    return Result(
        index=item["index"],
        hash=item["hash"],
        status=item["status"],
        source=item.get("source"),
        num_tokens=item.get("num_tokens"),
        shape=tuple(shape) if shape is not None else (),
        dtype=item.get("dtype"),
        meta=item.get("meta") or {},
        data=data,
        replica=replica,
        key=item.get("key"),
        model=answer.get("model"),
        fingerprint=answer.get("fingerprint"),
    )


def _encode_safetensors(blob: bytes, replica: str) -> list[Result]:
    """A safetensors answer, read by the one strict codec: a bad offset is an error, never a
    silently truncated tensor."""
    tensors, metadata = load_safetensors(blob)
    out = []
    for item in json.loads(metadata["items"]):
        tensor = tensors.get(str(item["index"]))
        out.append(_result(item, tensor.data if tensor else b"", replica, metadata))
    return out
