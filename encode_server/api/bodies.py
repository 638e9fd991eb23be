"""Request bodies to ``RequestItem``s: JSON, multipart, or one raw image. Pure parsing, no I/O
beyond reading the body under its size limit.

Every copy of the request that parsing makes is charged, before it is made, to the budget hold
each parser is handed (the request's, which the door takes from ``api/budget.py``): the parsed
JSON text, decoded base64, multipart parts; once parsed, the hold is settled to the bytes the
items still hold. A charge that does not fit raises ``OverBudget``, which the budget middleware
answers with 503 ``overloaded``."""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import orjson
import pybase64
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.types import Message

from encode_server.api.frontdoor import check_count, item_settings, request_item
from encode_server.api.schemas import EncodeItemIn, EncodeRequestIn, LookupRequestIn, TokensRequestIn
from encode_server.core.budget import Hold
from encode_server.core.errors import BadInput, InvalidRequest, TooLarge, UnsupportedMediaType
from encode_server.core.types import AUDIO, IMAGE, VIDEO, RequestItem, Return

__all__ = [
    "EncodeBody",
    "LookupBody",
    "TokensBody",
    "media_type",
    "parse_encode_body",
    "parse_lookup_body",
    "parse_tokens_body",
    "read_body",
]

_DATA_URL = re.compile(r"data:(image|video|audio)/[\w.+-]+(;[\w.+-]+=[\w.+-]+)*;base64,", re.IGNORECASE)
# Line wrapping (MIME, PEM) that some encoders insert; removed with bytes.translate, not a regex.
_WHITESPACE = b" \t\n\r\v\f"


@dataclass(frozen=True)
class EncodeBody:
    items: list[RequestItem]
    return_kind: Return


@dataclass(frozen=True)
class TokensBody:
    """Uploads or sizes (exactly one is non-empty once the service has checked it); ``settings``:
    the request's ``mm_processor_kwargs``, the sizes' (each upload carries its own)."""

    items: list[RequestItem]
    sizes: list[list[int]]
    settings: dict[str, Any] | None = None


@dataclass(frozen=True)
class LookupBody:
    hashes: list[str]
    modality: str
    settings: dict[str, Any] | None = None


def media_type(request: Request) -> str:
    raw = request.headers.get("content-type", "application/json")
    return raw.split(";", 1)[0].strip().lower()


def _transient(hold: Hold | None, nbytes: int) -> AbstractContextManager[None]:
    return hold.transient(nbytes) if hold is not None else nullcontext()


def _settle(hold: Hold | None, items: list[RequestItem]) -> None:
    """From now on the request holds only its items' bytes (the body and parsed text are gone)."""
    if hold is not None:
        held = sum(len(item.data) for item in items if item.data is not None)
        hold.settle(min(held, hold.held))  # only gives back: every byte was charged before it was made


async def read_body(request: Request, max_bytes: int, hold: Hold | None = None) -> bytes:
    """The whole body, refusing (413) past ``max_bytes`` before reading it all.

    A body in one piece is returned as it came. One in many pieces is copied, as it arrives, into
    one buffer of its declared length, each piece freed at once: a list of pieces joined at the
    end would leave them all freed together in the allocator's heap, which a burst of uploads
    then keeps (``encode_server.malloc``)."""
    declared = request.headers.get("content-length")
    expected = int(declared) if declared is not None and declared.isdigit() else None
    if expected is not None and expected > max_bytes:
        raise TooLarge(f"request body is {declared} bytes, above the limit of {max_bytes} (--max-request-bytes)")
    first: bytes | None = None
    buffer: bytearray | None = None
    size = 0
    async for chunk in request.stream():
        if first is None:
            first, size = chunk, len(chunk)
            continue
        if size + len(chunk) > max_bytes:
            raise TooLarge(f"request body is above the limit of {max_bytes} bytes (--max-request-bytes)")
        if buffer is None:
            buffer = bytearray(max(expected or 0, size))  # chunked (nothing declared): grows
            buffer[:size] = first
        buffer[size : size + len(chunk)] = chunk  # past the end, this appends
        size += len(chunk)
        del chunk
    if buffer is None:
        if size > max_bytes:
            raise TooLarge(f"request body is above the limit of {max_bytes} bytes (--max-request-bytes)")
        return first or b""
    del buffer[size:]
    with _transient(hold, size):  # the buffer and its bytes, for a moment
        return bytes(buffer)


def _load_json(body: bytes) -> Any:
    if not body.strip():
        raise BadInput("empty body: expected a JSON object", type="invalid_json")
    try:
        return orjson.loads(body)  # a third of json.loads' time on a body of base64
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"body is not valid JSON: {exc}", type="invalid_json") from exc


def _validation_error(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    index = int(loc[1]) if len(loc) > 1 and loc[0] in ("items", "hashes", "sizes") and loc[1].isdigit() else None
    where = ".".join(loc) or "body"
    return InvalidRequest(f"{where}: {first['msg']}", index=index)


def _check_count(obj: Any, field: str, limit: int) -> None:
    """The front doors' count rule, before validation: a huge list is refused before it is walked.
    (An empty list is left to the schema, which names the field.)"""
    if isinstance(obj, dict) and isinstance(obj.get(field), list) and len(obj[field]) > limit:
        check_count(len(obj[field]), limit, field)


def decode_base64(text: str, index: int, hold: Hold | None = None) -> bytes:
    """Standard base64, or a ``data:image/...;base64,`` URL; whitespace (line wrapping) ignored.

    With a ``hold``, the decoded bytes (kept) and any working copy (given back) are charged to it
    before they are made. Plain unwrapped base64 is decoded straight from the string, no copy, in
    one SIMD pass (pybase64) that checks the alphabet and the padding as it decodes; whitespace is
    only looked for when that pass refuses the input. No regex ever runs over the payload: only
    over a data URL's short prefix."""
    if hold is not None:
        hold.grow_or_raise(len(text) * 3 // 4 + 3)
    if text[:5].lower() == "data:":
        match = _DATA_URL.match(text, 0, 256)
        if match is None:
            raise BadInput("only data:image/, data:video/ and data:audio/...;base64, URLs are accepted",
                       type="invalid_base64", index=index)
        with _transient(hold, len(text)):  # the slice is a copy
            return _decode_base64_copying(text[match.end():], index, hold)
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return _decode_base64_copying(text, index, hold)


def _decode_base64_copying(text: str, index: int, hold: Hold | None) -> bytes:
    try:
        with _transient(hold, 2 * len(text)):  # ASCII bytes, then without whitespace
            raw = text.encode("ascii").translate(None, _WHITESPACE)
            return pybase64.b64decode(raw, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise BadInput(f"data is not valid base64: {exc}", type="invalid_base64", index=index) from exc


@contextmanager
def _parsed_text(hold: Hold | None, body: bytes) -> Iterator[None]:
    """While JSON is parsed and decoded, its strings are about the body's size again."""
    with _transient(hold, len(body)):
        yield


def _json_items(body: bytes, max_items: int, hold: Hold | None = None) -> EncodeBody:
    with _parsed_text(hold, body):
        obj = _load_json(body)
        _check_count(obj, "items", max_items)
        try:
            parsed = EncodeRequestIn.model_validate(obj)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        del obj
        return EncodeBody(_decode_items(parsed.items, hold, parsed.mm_processor_kwargs), Return(parsed.return_))


def _decode_items(
    parsed: list[EncodeItemIn], hold: Hold | None = None, settings: dict[str, Any] | None = None
) -> list[RequestItem]:
    items = []
    for index, item in enumerate(parsed):
        data = decode_base64(item.data, index, hold) if item.data is not None else None
        modality = item.modality or _modality((item.data or "")[5:11] if (item.data or "")[:5].lower() == "data:"
                                              else None)
        items.append(request_item(index, item.hash, data, modality, item_settings(settings, item.mm_processor_kwargs)))
    return items


def _modality(content_type: str | None) -> str:
    """A part or body sent as ``video/*`` is a video, as ``audio/*`` an audio file; anything else an image."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return VIDEO if kind.startswith("video/") else AUDIO if kind.startswith("audio/") else IMAGE


async def _multipart_items(request: Request, max_items: int, max_bytes: int, hold: Hold | None) -> EncodeBody:
    try:
        form = await request.form(max_files=max_items, max_fields=max_items + 16, max_part_size=max_bytes)
    except (MultiPartException, HTTPException) as exc:  # Request.form() wraps the former in the latter
        detail = str(getattr(exc, "detail", None) or getattr(exc, "message", exc))
        if "too many files" in detail.lower():
            raise TooLarge(f"more than {max_items} files in one request (--max-items)", type="too_many_items") from exc
        if "part exceeded maximum size" in detail.lower():
            raise TooLarge(f"a part is above the limit of {max_bytes} bytes (--max-request-bytes)") from exc
        raise InvalidRequest(f"malformed multipart body: {detail}") from exc
    except (ValueError, KeyError, AssertionError) as exc:  # python-multipart on broken framing
        raise InvalidRequest(f"malformed multipart body: {exc}") from exc
    try:
        files = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
        if len(files) > max_items:
            raise TooLarge(f"more than {max_items} files in one request (--max-items)", type="too_many_items")
        if not files:
            raise InvalidRequest("multipart body has no file parts")
        items = []
        for i, f in enumerate(files):
            if hold is not None:
                hold.grow_or_raise(f.size or 0)  # the part, read out of its spool file
            items.append(RequestItem(index=i, data=await f.read(), modality=_modality(f.content_type)))
        ret = form.get("return", "embeddings")
        if ret not in ("embeddings", "metadata"):
            raise InvalidRequest('"return" must be "embeddings" or "metadata"')
        return EncodeBody(items, Return(ret))
    finally:
        await form.close()


async def parse_encode_body(request: Request, *, max_items: int, max_bytes: int, hold: Hold | None = None
                            ) -> EncodeBody:
    """The items of an upload body; ``hold`` (the request's budget hold) then holds what they hold."""
    parsed = await _parse_encode_body(request, max_items, max_bytes, hold)
    _settle(hold, parsed.items)
    return parsed


async def _parse_encode_body(request: Request, max_items: int, max_bytes: int, hold: Hold | None) -> EncodeBody:
    kind = media_type(request)
    if kind == "multipart/form-data":
        # Read under the limit first, then let Starlette parse the bytes we hold: its own limits
        # bound fields, not files.
        body = await read_body(request, max_bytes, hold)

        async def replay() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        # The parser hands each part on as one slice of the body: a copy, while it is parsed.
        with _transient(hold, len(body)):
            return await _multipart_items(Request(request.scope, replay), max_items, max_bytes, hold)
    media = ("image/", "video/", "audio/")
    if kind not in ("application/json", "application/octet-stream") and not kind.startswith(media):
        raise UnsupportedMediaType(
            f"unsupported content type {kind!r}: use application/json, multipart/form-data, "
            "image/*, video/*, audio/* or application/octet-stream"
        )
    body = await read_body(request, max_bytes, hold)
    if kind == "application/json":
        # Parsed on the loop whatever the size: orjson and SIMD base64 take well under 1 ms per MiB
        # holding the GIL, so a thread would only add a hop and a GIL hand-off, not overlap.
        return _json_items(body, max_items, hold)
    if not body:
        raise BadInput("empty body: expected the bytes of one image, video or audio file", type="invalid_image",
                       index=0)
    return EncodeBody([RequestItem(index=0, data=body, modality=_modality(kind))], Return.EMBEDDINGS)


async def parse_lookup_body(request: Request, *, max_hashes: int, max_bytes: int, hold: Hold | None = None
                            ) -> LookupBody:
    """``{"hashes": [...], "modality": "image"|"video", "mm_processor_kwargs": {...}}``: the hashes,
    what they are and under which settings."""
    if media_type(request) != "application/json":
        raise UnsupportedMediaType("/v1/lookup takes application/json")
    obj = _load_json(await read_body(request, max_bytes, hold))
    _check_count(obj, "hashes", max_hashes)
    try:
        parsed = LookupRequestIn.model_validate(obj)
        return LookupBody(parsed.hashes, parsed.modality, parsed.mm_processor_kwargs)
    except ValidationError as exc:
        raise _validation_error(exc) from None


async def parse_tokens_body(request: Request, *, max_items: int, max_sizes: int, max_bytes: int,
                            hold: Hold | None = None) -> TokensBody:
    """``{"sizes": [[w, h], ...]}``, ``{"items": [...]}``, or any upload body /v1/encode takes."""
    if media_type(request) != "application/json":
        encoded = await parse_encode_body(request, max_items=max_items, max_bytes=max_bytes, hold=hold)
        return TokensBody(encoded.items, [])
    body = await read_body(request, max_bytes, hold)
    with _parsed_text(hold, body):
        obj = _load_json(body)
        _check_count(obj, "items", max_items)
        _check_count(obj, "sizes", max_sizes)
        try:
            parsed = TokensRequestIn.model_validate(obj)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        items = _decode_items(parsed.items or [], hold, parsed.mm_processor_kwargs)
    _settle(hold, items)
    return TokensBody(items, parsed.sizes or [], parsed.mm_processor_kwargs)
