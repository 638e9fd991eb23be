"""Request-body schemas for the OpenAPI document that resolve inside it.

A pydantic model's JSON schema keeps its nested models under a local ``$defs`` and points at them
with ``#/$defs/Name``. Pasted into an OpenAPI document under ``requestBody`` those pointers are
relative to the document's root, where there is no ``$defs``: client generators and fuzzers then
skip the body. Inlining the definitions (the request models are not recursive) makes every body
self-contained, so each ``$ref`` left in the document is one FastAPI itself wrote and resolves.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["inline_defs", "request_body_doc"]

_DEFS_PREFIX = "#/$defs/"


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``#/$defs/...`` reference replaced by its definition, and no ``$defs``.

    Raises ``ValueError`` on a recursive definition (it cannot be inlined) or a dangling reference.
    """
    defs: dict[str, Any] = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(x, seen) for x in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS_PREFIX):
            name = ref[len(_DEFS_PREFIX):]
            if name in seen:
                raise ValueError(f"recursive schema {name!r} cannot be inlined")
            if name not in defs:
                raise ValueError(f"dangling reference {ref!r}")
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            return {**resolve(defs[name], (*seen, name)), **resolve(siblings, seen)}
        return {k: resolve(v, seen) for k, v in node.items() if k != "$defs"}

    out = resolve(schema, ())
    assert isinstance(out, dict)
    return out


def request_body_doc(model: type[BaseModel], *extra_media: str) -> dict[str, Any]:
    """``openapi_extra`` for a route: a required JSON body of ``model``, plus raw ``extra_media``."""
    content: dict[str, Any] = {"application/json": {"schema": inline_defs(model.model_json_schema(by_alias=True))}}
    for media in extra_media:
        content[media] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "content": content}}
