"""The EPD request path: an OpenAI chat-completions request with images, rewritten for a prefill
worker that takes its image embeddings from encode-server (an EC consumer, see
``encode_client.vllm_connector``).

Every image part (``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``) is
handed to encode-server first (hash only; the bytes go only for images no tier holds), with
``"return": "metadata"``, so that its embedding is in the shared tier when the request leaves; the
part is then replaced by a metadata-only embeddings part keyed by the image's ``mm_hash``::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 16, 22]}, "uuid": "<mm_hash>"}

The prefill worker sees no pixels: vLLM sizes the image's placeholder from the metadata and asks
its EC connector for ``uuid``, which reads the embedding from the shared tier.

Only ``data:`` URLs are accepted: fetching ``http(s)://`` URLs would make the proxy an open fetcher
(SSRF), so such a part is refused with a clear error naming it. Parts that already carry
``image_embeds`` pass through unchanged. Works for models whose embeddings vLLM sizes from
encode-server's metadata: Qwen2-VL and Qwen2.5-VL (``image_grid_thw``).
"""

from __future__ import annotations

import base64
import binascii
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from encode_client._client import AsyncClient, Client
from encode_client._types import Result

__all__ = ["EPDError", "ImagePart", "find_image_parts", "rewrite_chat_request", "rewrite_chat_request_async"]


class EPDError(ValueError):
    """A request the EPD path cannot rewrite; ``where`` names the part (``messages[1].content[0]``)."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


@dataclass(frozen=True)
class ImagePart:
    message: int
    part: int
    data: bytes

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def _data_url_bytes(url: object, where: str) -> bytes:
    if not isinstance(url, str):
        raise EPDError("image_url.url must be a string", where)
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a relative URL"
        raise EPDError(f"only data: URLs are accepted (the proxy fetches nothing), got {scheme}", where)
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise EPDError("a data: URL must be base64 (data:image/png;base64,...)", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EPDError("the data: URL's payload is not valid base64", where) from None


def find_image_parts(body: Mapping[str, Any]) -> list[ImagePart]:
    """The image parts of ``body["messages"]``, decoded, in order."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise EPDError("messages must be a list")
    out = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            where = f"messages[{m}].content[{p}]"
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
            out.append(ImagePart(m, p, _data_url_bytes(url, where)))
    return out


def _embeds_part(result: Result) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": dict(result.meta), "uuid": result.hash}


def _apply(body: Mapping[str, Any], parts: list[ImagePart], results: list[Result]) -> dict[str, Any]:
    out = copy.deepcopy(dict(body))
    for part, result in zip(parts, results, strict=True):
        if result.status == "miss" or not result.meta:
            raise EPDError(f"encode-server returned no metadata for image {result.hash} ({result.status})", part.where)
        out["messages"][part.message]["content"][part.part] = _embeds_part(result)
    return out


def rewrite_chat_request(body: Mapping[str, Any], client: Client) -> tuple[dict[str, Any], list[Result]]:
    """``body`` with each image part replaced by its metadata-only, ``uuid``-keyed embeddings part.

    Each image is in encode-server's shared tier when this returns (``client.hand_off``). Raises
    ``EPDError`` for a part it cannot read, and the client's errors (``ServerError``,
    ``ReplicaUnavailable``) when encode-server refuses or does not answer. ``body`` is not changed.
    """
    parts = find_image_parts(body)
    if not parts:
        return copy.deepcopy(dict(body)), []
    results = client.hand_off([p.data for p in parts])
    return _apply(body, parts, results), results


async def rewrite_chat_request_async(
    body: Mapping[str, Any], client: AsyncClient
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request`` with an ``AsyncClient``."""
    parts = find_image_parts(body)
    if not parts:
        return copy.deepcopy(dict(body)), []
    results = await client.hand_off([p.data for p in parts])
    return _apply(body, parts, results), results
