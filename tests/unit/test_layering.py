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


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "encode_server/api").glob("*.py")))
def test_nothing_where_the_front_doors_live_wires_the_server(module: str) -> None:
    # ``api/model.py`` (what GET /v1/model publishes) reads the service it is given, builds nothing.
    modules = imported_modules(ROOT / f"encode_server/api/{module}.py")
    wiring = sorted(m for m in modules if any(m == w or m.startswith(w + ".") for w in WIRING))
    assert wiring == [], f"api/{module}.py wires what the composition root should: {wiring}"


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# Imports point one way: the front doors -> the service -> (kinds, admission, tiers, batcher, encoders)
# -> the pure core. Each layer, and what sits above it (it must never import).
ABOVE = {
    "encode_server/service.py": ("encode_server.api", "encode_server.app"),
    "encode_server/admission.py": ("encode_server.service", "encode_server.api", "encode_server.app",
                                   "encode_server.cache", "encode_server.core.batcher"),
    "encode_server/kinds": ("encode_server.service", "encode_server.api", "encode_server.app",
                            "encode_server.cache", "encode_server.core.batcher"),
    "encode_server/cache": ("encode_server.service", "encode_server.admission", "encode_server.api",
                            "encode_server.app"),
    "encode_server/encoders": ("encode_server.service", "encode_server.admission", "encode_server.kinds",
                               "encode_server.api",
                               "encode_server.app", "encode_server.cache"),
}


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    path = ROOT / layer
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    upward = {str(f.relative_to(ROOT)): sorted(m for m in _imports_inside_functions_too(f) if _within(m, ABOVE[layer]))
              for f in files}
    assert {f: m for f, m in upward.items() if m} == {}, f"{layer} imports what sits above it"


CORE = ("encode_server.core",)


def test_the_core_imports_only_the_core_of_the_server() -> None:
    files = sorted((ROOT / "encode_server/core").glob("*.py"))
    outside = {str(f.relative_to(ROOT)): sorted(m for m in _imports_inside_functions_too(f)
                                                if _within(m, ("encode_server",)) and not _within(m, CORE))
               for f in files}
    assert {f: m for f, m in outside.items() if m} == {}, "the core is pure: stdlib, numpy and itself"


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


# What the rest of the server may import from encoders/: the package's API (``load_encoder``,
# ``FAMILIES``...), the interface every family implements (its ``peak_memory`` included) and the
# cores torch shares. Everything a family knows stays in its module:
# the server asks the encoder (``VideoPlan.nbytes``, not a family's own ``frames_nbytes``), so a
# new family is one module and nothing outside changes.
ENCODER_SURFACE = ("encode_server.encoders", "encode_server.encoders.base", "encode_server.encoders.threads")


def _imports_inside_functions_too(path: Path) -> set[str]:
    """Every import of ``path``, a module's or a function's, relative ones resolved in the package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if module == "encode_server.encoders")
    return found


def test_no_module_outside_encoders_imports_a_family_module() -> None:
    outside = [p for p in (ROOT / "encode_server").rglob("*.py") if "encoders" not in p.relative_to(ROOT).parts]
    assert len(outside) > 20, "the walk found the server's modules"
    leaks = {}
    for path in outside:
        reached = {m for m in _imports_inside_functions_too(path)
                   if m.startswith("encode_server.encoders.") and m not in ENCODER_SURFACE}
        # ``from encode_server.encoders import load_encoder``: names from the package, not modules.
        reached = {m for m in reached if (ROOT / (m.replace(".", "/") + ".py")).is_file()}
        if reached:
            leaks[str(path.relative_to(ROOT))] = sorted(reached)
    assert leaks == {}, f"family knowledge reached from outside encoders/: {leaks}"
