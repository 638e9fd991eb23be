"""Test-environment shim: lets PyPI's CUDA-built torchvision import beside the CPU torch.

PyPI's only torchvision wheels for x86_64 Linux are CUDA builds: their ``_C`` ops library links
``libtorch_cuda.so``, which a CPU torch lacks, so it does not load. torchvision copes with that
(``extension._has_ops()`` is then False and the pure-torch transforms still work) except for two
``register_fake("torchvision::nms"/"qnms")`` calls at import, which need the operator schemas that
``_C`` would have declared. This declares those two schemas, without kernels, the first time
anything imports torchvision. Nothing of torchvision is changed; a call to ``torchvision.ops.nms``
still fails (no kernel), and neither vLLM's image path nor transformers' image processors use it.

Installed into the cached vLLM test venv only (``make vllm-env``), by a ``.pth`` line; never in
the product. Remove it when a CPU torchvision matching torch 2.13 can be installed.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op, schema in _SCHEMAS.items():
            if not _declared(op):
                torch.library.define(f"torchvision::{op}", schema)
        return None  # the normal import goes on


def _declared(op: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, op)
        return True
    except (AttributeError, RuntimeError):
        return False


def install() -> None:
    if not any(isinstance(f, _DeclareTorchvisionOps) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeclareTorchvisionOps())
