"""The proxy's rewrite step: a POST body as vLLM gets it. No HTTP of its own (encode-server is
reached through the ``AsyncClient`` it is given) and no metrics: it says what it handed off, and the
app records it. It raises what ``_proxy_errors.REWRITE_ERRORS`` lists."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from encode_client._client import AsyncClient
from encode_client.epd import (
    EpdContract,
    EPDError,
    cache_salt,
    check_chat_request,
    check_request_fields,
    rewrite_chat_plan_async,
)

__all__ = ["CHAT", "Prepared", "prepare_body"]

CHAT = "/v1/chat/completions"
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


@dataclass(frozen=True)
class Prepared:
    """The body for vLLM, and what its rewrite handed off (``handoff_seconds`` None: nothing)."""

    body: bytes
    images: int = 0
    videos: int = 0
    handoff_seconds: float | None = None
    audios: int = 0


async def prepare_body(
    raw: bytes,
    path: str,
    *,
    encoder: AsyncClient,
    contract: Callable[[], Awaitable[EpdContract]],
    tenant: str | None,
    trust_client_embeds: bool,
    trust_request_mm_kwargs: bool = False,
) -> Prepared:
    """``raw``, a POST to ``path``, checked and rewritten: a chat's images, videos and audio handed off
    (``epd``; ``contract`` is read after the checks, only for a request with media), the fields
    that steer vLLM's caches refused (``mm_processor_kwargs`` taken when trusted), and ``cache_salt``
    derived from ``tenant``."""
    parsed = _json_object(raw, "chat completion" if path == CHAT else "completion")
    images = videos = audios = 0
    seconds: float | None = None
    if path == CHAT:
        started = time.perf_counter()
        plan = check_chat_request(parsed, trust_client_embeds=trust_client_embeds,
                                  trust_request_mm_kwargs=trust_request_mm_kwargs)
        rewritten, results = await rewrite_chat_plan_async(parsed, plan, encoder, contract=contract)
        if results:
            seconds = time.perf_counter() - started
        images, videos, audios = len(plan.images), len(plan.videos), len(plan.audios) + len(plan.sounds)
    else:
        check_request_fields(parsed, trust_request_mm_kwargs=trust_request_mm_kwargs)
        rewritten = dict(parsed)
    rewritten["cache_salt"] = cache_salt(tenant, parsed.get("cache_salt"))
    return Prepared(json.dumps(rewritten).encode(), images, videos, seconds, audios)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    """The body as a JSON object, or an ``EPDError`` saying what was expected instead of the
    parser's own words (``Expecting value: line 1 column 1 (char 0)`` for an empty body)."""
    expected = f"expected a JSON {what} request"
    if not raw.strip():
        raise EPDError(f"request body is empty; {expected}")
    try:
        text = raw.decode("utf-8")  # JSON's one encoding between systems (RFC 8259)
    except UnicodeDecodeError:
        raise EPDError(f"request body is not UTF-8 text; {expected}") from None
    try:
        parsed: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EPDError(f"request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                       f"{expected}") from None
    if not isinstance(parsed, dict):
        kind = _JSON_KINDS.get(type(parsed), "value")
        raise EPDError(f"request body must be a JSON object, got {kind}; {expected}")
    return parsed
