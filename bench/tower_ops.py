"""What a tower's forward pass asks of the machine, counted: aten ops, attention calls, host syncs.

On a GPU each aten op is about one kernel launch, and a host sync (``.item()``, ``.tolist()``, an
op whose output size depends on the data) drains the launch queue; both are properties of the code,
not of the chip, so they are counted here on the CPU, through the project's own ``load_encoder``
and ``forward``, on a warm pass (the per-grid plans made, as after the server's warm-up).

- ops: every aten op dispatched (``TorchDispatchMode``), per image.
- attention calls: calls of ``F.scaled_dot_product_attention`` (a ``TorchFunctionMode``, which sees
  them before they decompose) and of the ``varlen_attn`` kernel's op, per forward.
- syncs: ``Tensor.tolist`` and ``Tensor.item`` calls, ``aten._local_scalar_dense`` not under them,
  and data-dependent-size ops (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
  without an output size), per forward. On the CPU they cost nothing; on a GPU each waits.

``python -m bench.tower_ops`` prints every family's counts at its reference input and the CPU
images/s of its tower, and merges ``tower_*`` keys into bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Counts", "count"]

_SYNC_OPS = frozenset({"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                       "aten.unique_consecutive.default", "aten.unique_dim.default"})
_ATTENTION = ("scaled_dot_product_attention",)


@dataclass
class Counts:
    ops: int = 0
    attention_calls: int = 0
    syncs: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"ops": self.ops, "attention_calls": self.attention_calls, "syncs": self.syncs}


class _Functions(TorchFunctionMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self.in_sync = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _ATTENTION:
            self.counts.attention_calls += 1
        if name in ("tolist", "item"):
            self.counts.syncs += 1
            self.in_sync += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.in_sync -= 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counts, functions: _Functions) -> None:
        super().__init__()
        self.counts = counts
        self.functions = functions

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts.ops += 1
        name = str(func)
        if name.endswith("_varlen_attn.default"):  # a custom op: no torch function to see it by
            self.counts.attention_calls += 1
        if name == "aten._local_scalar_dense.default" and not self.functions.in_sync:
            self.counts.syncs += 1
        elif name in _SYNC_OPS or (name == "aten.repeat_interleave.Tensor" and not (kwargs or {}).get("output_size")):
            self.counts.syncs += 1
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], Any]) -> tuple[Any, Counts]:
    """``fn()``'s result and what it dispatched."""
    counts = Counts()
    functions = _Functions(counts)
    with functions, _Ops(counts, functions):
        result = fn()
    return result, counts


# -- the families at their reference inputs --------------------------------------------------------

TINY_7B_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 64}


def _encoder(path: Path, dtype: str = "float32") -> Any:
    from encode_server.encoders import load_encoder

    return load_encoder(str(path), device="cpu", dtype=dtype)


def _images(encoder: Any, n: int) -> list[Any]:
    from bench.workload import photos

    return [encoder.prepare(data, max_pixels=50_000_000) for data in photos(0, n)]


def measure(encoder: Any, batch: list[Any], *, rounds: int = 3) -> dict[str, Any]:
    """Counts of a warm pass over ``batch`` and the tower's CPU images/s (best of ``rounds``)."""
    encoder.forward(batch)  # warm: per-grid plans, allocator
    _, counts = count(lambda: encoder.forward(batch))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        encoder.forward(batch)
        best = min(best, time.perf_counter() - start)
    return {**counts.as_dict(), "ops_per_image": round(counts.ops / len(batch), 1),
            "images_per_s": round(len(batch) / best, 2)}


def on_meta(encoder: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """``encoder`` moved to the meta device in ``dtype``: its forward runs the GPU path's control
    flow (the ``varlen_attn`` kernel's, in half precision) without computing, so that path's ops,
    attention calls and syncs can be counted here. Its rows come back as zeros."""
    encoder.module.to(device="meta", dtype=dtype)
    encoder.device, encoder.dtype = torch.device("meta"), dtype
    encoder._to_host = lambda t: torch.zeros(t.shape, dtype=t.dtype)
    return encoder


def device_counts(encoder: Any, batch: list[Any]) -> dict[str, Any]:
    """The GPU path's counts of a warm pass (``on_meta``)."""
    on_meta(encoder)
    encoder.forward(batch)
    _, counts = count(lambda: encoder.forward(batch))
    return {**counts.as_dict(), "ops_per_image": round(counts.ops / len(batch), 1)}


def qwen25_vl_7b_layout(n: int = 16) -> dict[str, Any]:
    """The 7B tower's layout (32 blocks, full attention at 7/15/23/31, 112-px windows) at tiny
    widths, ``n`` photo-like 640x480 JPEGs in one forward: the CPU path measured, the GPU path
    counted."""
    from bench.models import qwen25_vl_7b_vision_dir

    encoder = _encoder(qwen25_vl_7b_vision_dir(**TINY_7B_WIDTHS))
    batch = _images(encoder, n)
    return {"cpu": measure(encoder, batch), "device": device_counts(encoder, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results/latest.json"))
    parser.add_argument("--images", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    figures = {"qwen2_5_vl_7b_layout": qwen25_vl_7b_layout(args.images)}
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
