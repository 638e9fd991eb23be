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

``python -m bench.tower_ops`` measures every variable-length family (tiny seeded checkpoints, the
tests' builders) at its reference inputs: 16 photo-like 640x480 JPEGs in one forward, and where the
family takes them one 10 s video and one 30 s audio, each prepared as the service prepares it. It
prints each one's counts and CPU images/s and merges ``tower_*`` keys into
bench/results/latest.json (``tower_detail``: all of it, and why a GPU path could not be counted).
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
        unsized = name == "aten.repeat_interleave.Tensor" and not (kwargs or {}).get("output_size")
        if (name == "aten._local_scalar_dense.default" and not self.functions.in_sync) or name in _SYNC_OPS or unsized:
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
VIDEO_SECONDS, VIDEO_FPS, AUDIO_SECONDS = 10, 10, 30

# family -> (its tiny checkpoint's builder, given a directory; the inputs it takes besides images)
_Builder = Callable[[Path], Path]


def _builders() -> dict[str, tuple[_Builder, tuple[str, ...]]]:
    """Tiny seeded checkpoints, built by the tests' helpers (no download); imported here so that
    ``count`` needs nothing from tests/."""
    from bench.models import qwen25_vl_7b_vision_dir
    from tests.tiny.glm4v import make_tiny_glm4v
    from tests.tiny.kimi_k25 import make_tiny_kimi_k25
    from tests.tiny.mistral3 import make_tiny_mistral3
    from tests.tiny.qwen2_5_omni import make_tiny_qwen2_5_omni
    from tests.tiny.qwen2_audio import make_tiny_qwen2_audio
    from tests.tiny.qwen3_omni import make_tiny_qwen3_omni
    from tests.tiny_models import make_qwen2_vl, make_qwen3

    return {
        "qwen2_vl": (make_qwen2_vl, ("video",)),
        "qwen2_5_vl": (lambda _: qwen25_vl_7b_vision_dir(**TINY_7B_WIDTHS), ("video",)),
        "qwen3_vl": (lambda d: make_qwen3(d, "qwen3_vl"), ("video",)),
        "qwen3_5": (lambda d: make_qwen3(d, "qwen3_5"), ("video",)),
        "qwen2_5_omni": (make_tiny_qwen2_5_omni, ("video", "audio")),
        "qwen3_omni": (make_tiny_qwen3_omni, ("video", "audio")),
        "glm4v": (make_tiny_glm4v, ()),
        "kimi_k25": (make_tiny_kimi_k25, ()),
        "mistral3": (make_tiny_mistral3, ()),
        "qwen2_audio": (make_tiny_qwen2_audio, ("audio",)),
    }


def _encoder(path: Path, dtype: str = "float32") -> Any:
    from encode_server.encoders import load_encoder

    return load_encoder(str(path), device="cpu", dtype=dtype)


def _images(encoder: Any, n: int) -> list[Any]:
    from bench.workload import photos
    from encode_server.kinds import image_inputs

    return [image_inputs(encoder, data, max_pixels=50_000_000) for data in photos(0, n)]


def _prepared(encoder: Any, modality: str, data: bytes) -> list[Any]:
    """The service's way (its kind's ``prepare``: header planned, decoded as far as the family
    reads, preprocessed); one item, nothing charged."""
    from encode_server.admission import MemoryCharge
    from encode_server.config import Settings
    from encode_server.kinds import KINDS

    settings = Settings()
    memory = MemoryCharge(None, None, max_pixels=settings.max_image_pixels)  # type: ignore[arg-type]
    return [KINDS[modality](encoder, settings, memory).prepare(data, 0, None)]


def measure(encoder: Any, batch: list[Any], *, rounds: int = 20, budget_s: float = 3.0) -> dict[str, Any]:
    """Counts of a warm pass over ``batch`` and the tower's CPU images/s: best of ``rounds``, fewer
    (at least one) once ``budget_s`` is spent, so that a 15 s pass does not take a minute and a
    10 ms one is timed often enough for its best to mean something on a shared machine."""
    encoder.forward(batch)  # warm: per-grid plans, allocator
    _, counts = count(lambda: encoder.forward(batch))
    best, spent = float("inf"), 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        encoder.forward(batch)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent >= budget_s:
            break
    return {**counts.as_dict(), "ops_per_image": round(counts.ops / len(batch), 1),
            "images_per_s": round(len(batch) / best, 2)}


def on_meta(encoder: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """``encoder`` moved to the meta device in ``dtype``: its forward runs the GPU path's control
    flow (the ``varlen_attn`` kernel's, in half precision) without computing, so that path's ops,
    attention calls and syncs can be counted here. Its rows come back as zeros. Tensors and towers
    the adapter holds beside its module (Kimi-K2.5's normalisation, the Omni thinkers' audio tower)
    go too: loading puts them on the device."""
    encoder.module.to(device="meta", dtype=dtype)
    for name, value in list(vars(encoder).items()):
        if isinstance(value, torch.nn.Module):
            value.to(device="meta", dtype=dtype)
        elif isinstance(value, torch.Tensor):
            setattr(encoder, name, value.to("meta", dtype if value.is_floating_point() else value.dtype))
    encoder.device, encoder.dtype = torch.device("meta"), dtype
    encoder._to_host = lambda t: torch.zeros(t.shape, dtype=t.dtype)
    return encoder


def device_counts(encoder: Any, batch: list[Any]) -> dict[str, Any]:
    """The GPU path's counts of a warm pass (``on_meta``)."""
    on_meta(encoder)
    encoder.forward(batch)
    _, counts = count(lambda: encoder.forward(batch))
    return {**counts.as_dict(), "ops_per_image": round(counts.ops / len(batch), 1)}


def versus_loop(encoder: Any, batch: list[Any], *, rounds: int = 10, budget_s: float = 6.0) -> float | None:
    """A Qwen-style tower's CPU pass with one attention call per layer and its grid plan, over the
    same pass as transformers runs it (its sdpa loop, its own grid computations), alternated in one
    process so that the machine's load falls on both: best time of the loop / best time of the
    new path. None for a tower without the switch."""
    from encode_server.encoders.varlen import ATTENTION

    plan = getattr(encoder, "grid_plan", None)
    config = getattr(encoder.module, "config", None)
    if (plan is None or getattr(config, "_attn_implementation", None) != ATTENTION
            or "pixel_values" not in batch[0].inputs):  # an audio pass: another tower
        return None
    best = {True: float("inf"), False: float("inf")}
    spent = 0.0
    for _ in range(rounds):
        for new in (True, False):
            config._attn_implementation_internal = ATTENTION if new else "sdpa"
            plan.supported = new
            encoder.forward(batch)
            start = time.perf_counter()
            encoder.forward(batch)
            took = time.perf_counter() - start
            best[new], spent = min(best[new], took), spent + took
        if spent >= budget_s:
            break
    config._attn_implementation_internal, plan.supported = ATTENTION, True
    return round(best[False] / best[True], 3)


def family_figures(path: Path, batch_of: Callable[[Any], list[Any]], *, rounds: int = 20) -> dict[str, Any]:
    """One family at one input: the CPU path measured, then (the encoder moved to meta, so last)
    the GPU path counted, or why it cannot be."""
    encoder = _encoder(path)
    batch = batch_of(encoder)
    cpu = measure(encoder, batch, rounds=rounds)
    if (ratio := versus_loop(encoder, batch)) is not None:
        cpu["speedup_vs_loop"] = ratio
    try:
        device: dict[str, Any] | str = device_counts(encoder, batch)
    except Exception as exc:  # e.g. a .tolist() on a meta tensor: the forward syncs
        device = f"not countable: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return {"cpu": cpu, "device": device}


def qwen25_vl_7b_layout(n: int = 16) -> dict[str, Any]:
    """The 7B tower's layout (32 blocks, full attention at 7/15/23/31, 112-px windows) at tiny
    widths, ``n`` photo-like 640x480 JPEGs in one forward: the CPU path measured, the GPU path
    counted."""
    from bench.models import qwen25_vl_7b_vision_dir

    return family_figures(qwen25_vl_7b_vision_dir(**TINY_7B_WIDTHS), lambda e: _images(e, n))


def every_family(work: Path, n_images: int = 16, rounds: int = 20) -> dict[str, dict[str, Any]]:
    """Each variable-length family (and Qwen2-Audio) at its reference inputs: ``n_images`` photos in
    one forward; one 10 s video and one 30 s audio, each a one-item batch, where it takes them."""
    from tests.audios import make_audio
    from tests.videos import make_video

    video = make_video(VIDEO_SECONDS * VIDEO_FPS, VIDEO_FPS, 640, 480)
    audio = make_audio(AUDIO_SECONDS)
    inputs: dict[str, Callable[[Any], list[Any]]] = {
        "image": lambda e: _images(e, n_images), "video": lambda e: _prepared(e, "video", video),
        "audio": lambda e: _prepared(e, "audio", audio)}
    out: dict[str, dict[str, Any]] = {}
    for family, (build, extra) in _builders().items():
        path = build(work / family)
        for kind in (() if family == "qwen2_audio" else ("image",)) + extra:
            name = family if kind == "image" else f"{family}_{kind}"
            started = time.perf_counter()
            try:
                out[name] = family_figures(path, inputs[kind], rounds=rounds)
            except Exception as exc:
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out[name]["seconds"] = round(time.perf_counter() - started, 1)
            print(name, json.dumps(out[name]), flush=True)
    return out


def keys(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``latest.json``'s ``tower_*`` keys: the GPU path's counts (the CPU path's where the GPU path
    cannot be counted, as ``tower_detail`` says), the CPU path's, and everything in ``tower_detail``."""
    out: dict[str, Any] = {}
    for name, f in figures.items():
        if "cpu" not in f:
            continue
        cpu, device = f["cpu"], f["device"]
        gpu = device if isinstance(device, dict) else cpu
        out |= {f"tower_ops_per_image_{name}": gpu["ops_per_image"],
                f"tower_attention_calls_{name}": gpu["attention_calls"], f"tower_syncs_{name}": gpu["syncs"],
                f"tower_cpu_ops_per_image_{name}": cpu["ops_per_image"],
                f"tower_cpu_attention_calls_{name}": cpu["attention_calls"],
                f"tower_cpu_syncs_{name}": cpu["syncs"], f"tower_cpu_images_per_s_{name}": cpu["images_per_s"]}
        if "speedup_vs_loop" in cpu:
            out[f"tower_cpu_speedup_vs_loop_{name}"] = cpu["speedup_vs_loop"]
    return {**out, "tower_detail": figures}


def main() -> None:
    import tempfile

    from bench.latest import RESULTS, merge_into

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tower_ops_") as work:
        figures = every_family(Path(work), args.images, args.rounds)
    merge_into(args.out, results := keys(figures))
    print(f"{args.out}: {len(results)} tower_* keys merged")


if __name__ == "__main__":
    main()
