"""The proxy's rewrite step, in two: a POST body checked (``check_body``, no I/O), then made into the
body vLLM gets (``prepare_body``, again for a retry). No HTTP of its own (encode-server is reached
through the ``AsyncClient`` it is given), no contract of its own (the app reads it and passes it in)
and no metrics: it says what it handed off, and the app records it. It raises what
``_proxy_errors.REWRITE_ERRORS`` lists."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from encode_client._client import AsyncClient
from encode_client.epd import (
    ChatPlan,
    EpdContract,
    EPDError,
    cache_salt,
    check_chat_request,
    check_request_fields,
    rewrite_chat_plan_async,
)

__all__ = ["CHAT", "Checked", "Prepared", "check_body", "prepare_body"]

CHAT = "/v1/chat/completions"
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


@dataclass(frozen=True)
class Checked:
    """A POST body parsed and checked, nothing handed off yet: what each rewrite of it starts from
    (a retry's included). ``plan``: a chat's (None: a completion)."""

    body: dict[str, Any]
    plan: ChatPlan | None = None

    @property
    def has_media(self) -> bool:
        """Whether the rewrite hands anything off (and so needs the family's contract)."""
        return self.plan is not None and bool(self.plan.media)


@dataclass(frozen=True)
class Prepared:
    """The body for vLLM, and what its rewrite handed off (``handoff_seconds`` None: nothing)."""

    body: bytes
    images: int = 0
    videos: int = 0
    handoff_seconds: float | None = None
    audios: int = 0


def check_body(raw: bytes, path: str, *, trust_client_embeds: bool, trust_request_mm_kwargs: bool = False) -> Checked:
    """``raw``, a POST to ``path``, as a JSON object checked before anything moves: a chat's parts
    (``epd.check_chat_request``), a completion's fields that steer vLLM's caches
    (``mm_processor_kwargs`` taken when trusted)."""
    parsed = _json_object(raw, "chat completion" if path == CHAT else "completion")
    if path != CHAT:
        check_request_fields(parsed, trust_request_mm_kwargs=trust_request_mm_kwargs)
        return Checked(parsed)
    return Checked(parsed, check_chat_request(parsed, trust_client_embeds=trust_client_embeds,
                                              trust_request_mm_kwargs=trust_request_mm_kwargs))


async def prepare_body(
    checked: Checked, *, encoder: AsyncClient, contract: EpdContract | None, tenant: str | None
) -> Prepared:
    """``checked`` as vLLM gets it: a chat's images, videos and audio handed off and rewritten in
    ``contract``'s modes (the proxy's, read before for a chat with media), and ``cache_salt``
    derived from ``tenant``. Each call hands the media off again."""
    rewritten, plan, seconds = dict(checked.body), checked.plan, None
    if plan is not None:
        started = time.perf_counter()
        rewritten, results = await rewrite_chat_plan_async(checked.body, plan, encoder, contract=contract)
        if results:
            seconds = time.perf_counter() - started
    rewritten["cache_salt"] = cache_salt(tenant, checked.body.get("cache_salt"))
    body = json.dumps(rewritten).encode()
    if plan is None:
        return Prepared(body)
    return Prepared(body, len(plan.images), len(plan.videos), seconds, len(plan.audios) + len(plan.sounds))


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
