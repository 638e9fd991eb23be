"""docs/api.md has one row per error type, with the HTTP status and gRPC code the code answers.

The types are collected from the code, not from a list kept by hand: every error class's default
``type``, every ``type="..."`` literal given to an error class anywhere in ``encode_server/``,
and the types the HTTP door writes itself (404/405 and the catch-all ``internal``). The HTTP
status comes from ``api/status.py``'s ``status_for``; the gRPC code from the ``CODES`` mapping
(read from the source, so this test does not import torch through the gRPC door).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import grpc

from encode_server.api.status import status_for
from encode_server.core import errors
from tests.docs.markdown import ROOT, tables

PACKAGE = ROOT / "encode_server"
API_DOC = ROOT / "docs" / "api.md"
HEADER = ["type", "HTTP", "gRPC"]
NO_GRPC = "—"

ERROR_CLASSES: dict[str, type[errors.EncodeServerError]] = {
    name: obj
    for name, obj in vars(errors).items()
    if isinstance(obj, type) and issubclass(obj, errors.EncodeServerError)
}


@cache
def _sources() -> list[tuple[Path, ast.Module]]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "proto" not in p.relative_to(PACKAGE).parts)
    return [(p, ast.parse(p.read_text(), str(p))) for p in files]


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _status_dict(node: ast.AST | None) -> dict[int, str] | None:
    """``{404: "not_found", ...}``: HTTP statuses to error types, written out in the HTTP door."""
    if not isinstance(node, ast.Dict) or not node.keys:
        return None
    out = {}
    for key, value in zip(node.keys, node.values, strict=True):
        if not (isinstance(key, ast.Constant) and type(key.value) is int and 400 <= key.value < 600):
            return None
        if _str(value) is None:
            return None
        out[key.value] = _str(value)
    return out


def collect_types() -> tuple[dict[str, set[str]], dict[str, int | None], list[str]]:
    """(type -> error classes that carry it, type -> HTTP status of a literal-only type, problems)."""
    by_class: dict[str, set[str]] = defaultdict(set)
    literal: dict[str, int | None] = {}
    problems: list[str] = []

    def add(node: ast.AST | None, status: int | None = None) -> None:
        kind = _str(node)
        if kind is not None and (status is not None or kind not in literal):
            literal[kind] = status

    for cls in ERROR_CLASSES.values():
        by_class[cls.type].add(cls.__name__)
    for path, tree in _sources():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                given = next((_str(k.value) for k in node.keywords if k.arg == "type"), None)
                name = _callee(node)
                if given is not None and name in ERROR_CLASSES:
                    by_class[given].add(name)
                elif given is not None:
                    problems.append(f"{where}:{node.lineno}: type={given!r} given to {name}, not an error class")
                # {404: "not_found", ...}.get(status, "http_error")
                if name == "get" and _status_dict(getattr(node.func, "value", None)) and len(node.args) == 2:
                    add(node.args[1])
            elif isinstance(node, ast.Dict):
                for status, kind in (_status_dict(node) or {}).items():
                    literal[kind] = status
                # {"error": {"type": "internal", ...}}: an error body written out by hand
                for key, value in zip(node.keys, node.values, strict=True):
                    if _str(key) == "error" and isinstance(value, ast.Dict):
                        for inner_key, inner in zip(value.keys, value.values, strict=True):
                            if _str(inner_key) == "type":
                                add(inner)
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and _str(node.elts[0]) == "error-type":
                add(node.elts[1])  # gRPC trailing metadata written out by hand
    return by_class, {k: v for k, v in literal.items() if k not in by_class}, problems


@cache
def grpc_codes() -> list[tuple[str, str]]:
    """``CODES`` from the gRPC door's source: (error class name, StatusCode name), in order."""
    for path, tree in _sources():
        if path.parent.name != "api":
            continue
        for node in ast.walk(tree):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            if any(isinstance(t, ast.Name) and t.id == "CODES" for t in targets) and node.value is not None:
                pairs = []
                for elt in node.value.elts:  # type: ignore[attr-defined]
                    cls, code = elt.elts
                    pairs.append((cls.id, code.attr))
                return pairs
    raise AssertionError("no CODES mapping found under encode_server/api/")


def expected_grpc(cls: type[errors.EncodeServerError]) -> str:
    """What ``code_for`` answers for ``cls``: the first CODES entry it is an instance of."""
    for name, code in grpc_codes():
        if issubclass(cls, ERROR_CLASSES[name]):
            return code
    return "INTERNAL"


def documented() -> dict[str, tuple[str, str]]:
    """The error table of docs/api.md: type -> (HTTP cell, gRPC cell)."""
    found = [t for t in tables(API_DOC.read_text()) if t[0][:3] == HEADER]
    assert len(found) == 1, f"docs/api.md needs exactly one table whose header starts with {HEADER}"
    rows: dict[str, tuple[str, str]] = {}
    for row in found[0][1:]:
        match = re.fullmatch(r"`([a-z0-9_]+)`", row[0])
        assert match, f"first cell must be one `type`: {row}"
        assert match.group(1) not in rows, f"{match.group(1)} has two rows"
        rows[match.group(1)] = (row[1], row[2].strip("`"))
    return rows


def test_the_type_collector_reads_the_code() -> None:
    by_class, literal, problems = collect_types()
    assert problems == []
    # One of each kind the collector must find: a class default, a literal given to a class,
    # a status written out by the HTTP door, its default, and the catch-all.
    assert {"invalid_image", "invalid_request"} <= set(by_class)
    assert {"BadInput"} <= by_class["invalid_base64"]
    assert {"Unavailable"} <= by_class["shared_tier_unavailable"]
    assert literal.get("not_found") == 404
    assert "http_error" in literal
    assert "internal" in by_class  # the base class's type
    assert ("BadInput", "INVALID_ARGUMENT") in grpc_codes()


def test_every_error_type_has_its_row() -> None:
    by_class, literal, _ = collect_types()
    rows = documented()
    missing = sorted((set(by_class) | set(literal)) - set(rows))
    stale = sorted(set(rows) - set(by_class) - set(literal))
    assert missing == [], f"error types without a row in docs/api.md: {missing}"
    assert stale == [], f"rows in docs/api.md for types the code never answers: {stale}"


def test_http_status_and_grpc_code_match_the_code() -> None:
    by_class, literal, _ = collect_types()
    rows = documented()
    valid_codes = {c.name for c in grpc.StatusCode}
    wrong = []
    for kind, classes in sorted(by_class.items()):
        for name in sorted(classes):
            cls = ERROR_CLASSES[name]
            http, code = str(status_for(cls("probe", type=kind))), expected_grpc(cls)
            if rows.get(kind) != (http, code):
                wrong.append(f"{kind} ({name}): documented {rows.get(kind)}, code answers ({http}, {code})")
    for kind, status in sorted(literal.items()):
        http, code = rows[kind]
        if status is not None and http != str(status):
            wrong.append(f"{kind}: documented HTTP {http}, the HTTP door answers {status}")
        if code != NO_GRPC and code not in valid_codes:
            wrong.append(f"{kind}: {code} is not a gRPC status code")
    assert wrong == []



def test_each_error_class_declares_every_type_it_is_raised_with() -> None:
    """``types`` is the registry the OpenAPI document's error lists come from: every ``type=`` the
    code gives a class is declared on it, its default first, and each type on one class only."""
    by_class, _, _ = collect_types()
    undeclared = sorted(f"{kind} ({name})" for kind, names in by_class.items() for name in names
                        if kind not in ERROR_CLASSES[name].types)
    assert undeclared == [], f"raised but not in the class's types (core/errors.py): {undeclared}"
    for name, cls in ERROR_CLASSES.items():
        assert cls.types[0] == cls.type, name
    declared = [kind for cls in ERROR_CLASSES.values() for kind in cls.__dict__.get("types", ())]
    assert len(declared) == len(set(declared)), sorted(declared)


def test_the_openapi_documents_every_declared_type_under_its_status() -> None:
    from encode_server.api.http import _ENCODE_ERRORS

    for cls in ERROR_CLASSES.values():
        if cls is errors.EncodeServerError:
            continue
        description = _ENCODE_ERRORS[status_for(cls("probe"))]["description"]
        assert all(kind in description for kind in cls.types), (cls.__name__, description)
