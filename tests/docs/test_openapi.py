"""docs/openapi.json is exactly what a running server serves at /openapi.json: the file can never
go stale (`make openapi` rewrites it from the app factory)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.docs.markdown import ROOT
from tests.server import ServerProcess, start_server

EXPORTED = ROOT / "docs" / "openapi.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server("--grpc-port", "0", log_dir=tmp_path_factory.mktemp("openapi-server"))
    yield process
    assert process.stop() == 0, process.log()


def _diff(exported: object, served: object, where: str = "$") -> list[str]:
    """Where two JSON documents differ, as paths: a readable failure for a large document."""
    if isinstance(exported, dict) and isinstance(served, dict):
        out = []
        for key in sorted(set(exported) | set(served)):
            if key not in served:
                out.append(f"{where}.{key}: only in docs/openapi.json")
            elif key not in exported:
                out.append(f"{where}.{key}: only in the served document")
            else:
                out += _diff(exported[key], served[key], f"{where}.{key}")
        return out
    if isinstance(exported, list) and isinstance(served, list) and len(exported) == len(served):
        return [d for i, (a, b) in enumerate(zip(exported, served, strict=True)) for d in _diff(a, b, f"{where}[{i}]")]
    return [] if exported == served else [f"{where}: {json.dumps(exported)[:80]} != {json.dumps(served)[:80]}"]


def test_the_exported_document_is_what_the_server_serves(server: ServerProcess) -> None:
    served = httpx.get(server.url + "/openapi.json", timeout=10)
    assert served.status_code == 200
    exported = json.loads(EXPORTED.read_text())
    assert _diff(exported, served.json()) == [], "docs/openapi.json is stale: run `make openapi`"


def test_every_route_and_error_type_is_in_the_document() -> None:
    """The document covers what docs/api.md documents: every /v1 route, and each route's errors."""
    document = json.loads(EXPORTED.read_text())
    assert {"/v1/encode", "/v1/lookup", "/v1/tokens", "/v1/model", "/health", "/ready"} <= set(document["paths"])
    encode = document["paths"]["/v1/encode"]["post"]
    assert {"application/json", "multipart/form-data", "image/*", "application/octet-stream"} <= set(
        encode["requestBody"]["content"]
    )
    assert "application/vnd.safetensors" in encode["responses"]["200"]["content"]
    described = " ".join(r.get("description", "") for r in encode["responses"].values())
    for kind in ("invalid_hash", "unauthorized", "no_shared_tier", "too_many_items", "overloaded", "timeout"):
        assert kind in described


def test_the_diff_names_what_differs() -> None:
    assert _diff({"a": [1, {"b": 2}], "c": 1}, {"a": [1, {"b": 3}], "d": 1}) == [
        "$.a[1].b: 2 != 3", "$.c: only in docs/openapi.json", "$.d: only in the served document",
    ]

