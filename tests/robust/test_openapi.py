"""The OpenAPI document is the honest contract: every reference in it resolves inside it, so
client generators and fuzzers see every request body (they skipped /v1/encode and /v1/tokens
while those pointed at ``#/$defs/EncodeItemIn``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from encode_server.api.openapi import inline_defs
from tests.server import ServerProcess

pytestmark = pytest.mark.integration


def refs(node: Any, path: str = "#") -> list[tuple[str, str]]:
    if isinstance(node, dict):
        found = [(path, node["$ref"])] if isinstance(node.get("$ref"), str) else []
        for key, value in node.items():
            found += refs(value, f"{path}/{key}")
        return found
    if isinstance(node, list):
        return [r for i, v in enumerate(node) for r in refs(v, f"{path}/{i}")]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"external or relative reference {ref!r}"
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref!r} does not resolve (no {part!r})"
        node = node[part]
    return node


def test_every_ref_in_openapi_json_resolves(robust_server: ServerProcess) -> None:
    doc = httpx.get(robust_server.url + "/openapi.json").json()
    found = refs(doc)
    assert len(found) > 10  # the document does use references (responses, components)
    for where, ref in found:
        assert isinstance(resolve(doc, ref), dict), f"{where}: {ref}"
    assert "$defs" not in str(doc), "a pydantic-local $defs leaked into the document"


def test_request_bodies_describe_the_items(robust_server: ServerProcess) -> None:
    """The bodies the fuzzer generates from: items of hash/data (and the item's modality and
    processor settings), for /v1/encode and /v1/tokens."""
    doc = httpx.get(robust_server.url + "/openapi.json").json()
    for route in ("/v1/encode", "/v1/tokens"):
        schema = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        items = schema["properties"]["items"]
        item = next(s for s in items.get("anyOf", [items]) if s.get("type") == "array")["items"]
        assert set(item["properties"]) == {"hash", "data", "modality", "mm_processor_kwargs"}, route
        assert item["additionalProperties"] is False


def test_inline_defs_refuses_what_it_cannot_inline() -> None:
    with pytest.raises(ValueError, match="dangling"):
        inline_defs({"$ref": "#/$defs/Nope"})
    with pytest.raises(ValueError, match="recursive"):
        inline_defs({"$defs": {"A": {"properties": {"a": {"$ref": "#/$defs/A"}}}}, "$ref": "#/$defs/A"})
    assert inline_defs({"$defs": {"A": {"type": "string"}}, "items": {"$ref": "#/$defs/A"}}) == {
        "items": {"type": "string"}
    }
