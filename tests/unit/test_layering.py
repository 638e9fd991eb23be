"""The layering, read from the source: the front doors only translate, the composition root wires.

``api/http.py`` and ``api/grpc.py`` receive a ready ``Runtime``; neither imports the Redis tier,
the encoder loader, the batcher or the other door. Only ``encode_server/app.py`` builds them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOORS = {"http": ROOT / "encode_server/api/http.py", "grpc": ROOT / "encode_server/api/grpc.py"}
WIRING = ("encode_server.cache", "encode_server.encoders", "encode_server.core.batcher", "encode_server.app", "redis")


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_front_door_imports_no_tier_loader_batcher_or_other_door(door: str) -> None:
    modules = imported_modules(DOORS[door])
    other = "encode_server.api.grpc" if door == "http" else "encode_server.api.http"
    wiring = sorted(m for m in modules if m == other or any(m == w or m.startswith(w + ".") for w in WIRING))
    assert wiring == [], f"api/{door}.py wires what the composition root should: {wiring}"


def test_the_composition_root_builds_both_doors_and_the_tiers() -> None:
    modules = imported_modules(ROOT / "encode_server/app.py")
    for needed in ("encode_server.api.http", "encode_server.api.grpc", "encode_server.cache.redis",
                   "encode_server.cache.local", "encode_server.encoders"):
        assert needed in modules, needed
    cli = imported_modules(ROOT / "encode_server/cli.py")
    assert "encode_server.app" in cli and "uvicorn" not in cli and "encode_server.api.http" not in cli


def test_the_client_package_never_imports_the_server() -> None:
    for path in (ROOT / "clients/python/encode_client").rglob("*.py"):
        server = sorted(m for m in imported_modules(path) if m.split(".")[0] == "encode_server")
        assert server == [], f"{path.relative_to(ROOT)} imports {server}"
