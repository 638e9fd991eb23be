"""The pure core modules: an explicit public surface, and no heavy or I/O imports."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

MODULES = [
    "encode_server.core.hashing",
    "encode_server.core.wire",
    "encode_server.core.lru",
    "encode_server.core.breaker",
    "encode_server.core.stored",
    "encode_server.core.budget",
    "encode_server.core.sniff",
    "encode_server.core.sglang_wire",
]
FORBIDDEN = ["torch", "transformers", "fastapi", "starlette", "redis", "PIL", "safetensors", "grpc"]


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_exactly_the_public_functions_and_classes(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert all(hasattr(module, attr) for attr in exported)
    defined = {
        attr
        for attr, obj in vars(module).items()
        if not attr.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == name
    }
    assert defined <= exported, f"public but not in __all__: {sorted(defined - exported)}"


def test_core_modules_import_nothing_heavy() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in MODULES)
        + f"print(','.join(sorted(m for m in {FORBIDDEN!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
