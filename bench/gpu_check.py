"""The GPU check: what encode-server does on a GPU, each figure a ratio taken in one run.

Run by ``bench/gpu_check.sh`` on the lent GPU machine (under 6 minutes on an H200), and rehearsed
here on the CPU (``make gpu-rehearsal``: ``--device cpu --rehearsal``, shrunken towers, few images).
Two towers, random weights, real architectures (``bench/models.py``), bf16 on CUDA:

- ``qwen2_5_vl_7b``: Qwen2.5-VL-7B's vision tower (32 blocks of width 1280, merger to 3,584),
  640x480 images: 1,564 patches, 391 tokens each.
- ``siglip_so400m_384``: SigLIP so400m/14's at 384 px (27 layers of width 1152, 729 tokens), where
  the forward pass is short and preprocessing weighs most.

For each, on unique photo-like 640x480 JPEGs (``bench/workload.py``), interleaved rounds:

- ``forward_only_images_per_s``: the module's forward pass alone over batches of 16 already
  preprocessed on the device (the ceiling); ``forward_d2h_images_per_s`` adds the copy back to the
  host and the bytes.
- ``bare_images_per_s`` / ``bare_cpu_pre_images_per_s``: the in-process pipeline, batches of 16
  (header, decode, preprocess, forward, bytes), preprocessing on the device / on the CPU.
- ``server_images_per_s`` / ``server_cpu_pre_images_per_s``: the server at concurrency 16 (JSON
  base64 uploads, safetensors answers), ``--preprocess-device model`` / ``cpu``.
- ``s1_ratio`` (server over bare), ``s1_vs_forward_only``, ``gpu_over_cpu_preprocessing`` (server
  and bare), ``s1_overhead_ms`` (p50 of one request at a time, raw and JSON bodies, minus the bare
  batch-1 p50), ``gpu_busy_share`` (nvidia-smi's utilization over the server's c=16 windows, and
  the forward thread's busy share from the server's own ``forward_seconds``), ``peak_gpu_memory_mb``
  (the server process, from nvidia-smi; the bare pipeline, from torch), ``parity`` (the device
  path's embeddings against the CPU-preprocessing path's, same model and dtype).

Then the serving path's own ceiling (``bench.ceiling``: the zero-cost tower through each door at
concurrency 16 on this machine's cores, beside the bare pipeline; GIL ms where py-spy attaches),
under ``ceiling``. Then S2 (``bench.serving.s2``): hash-only hits of 64, 576 and 2,500 tokens of the Qwen tower's
3,584 bf16 against the raw wire. Each stage that fails is recorded under ``errors`` and the rest
goes on: one run on a lent machine must bring back every figure it can.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import encode_server.encoders  # noqa: F401  (first: OMP_WAIT_POLICY before torch loads)
from bench import ceiling, models
from bench.rawhttp import Conn, Request, post_many
from bench.serving import CONCURRENCY, MAX_PIXELS, RESULTS, S2_TOKENS, BarePipeline, Plan, checked, json_body, s2
from bench.workload import photos
from encode_server.kinds import image_inputs
from encode_server.malloc import tune_allocator
from tests.server import ServerProcess, start_server

__all__ = ["Sizes", "main", "table"]


@dataclass(frozen=True)
class Sizes:
    """How much each measurement does: the H200's run, and the CPU rehearsal's (which checks that
    every stage runs and every key is written, not the speed)."""

    images: int = 256  # per side at concurrency 16, in rounds of 64
    sequential: int = 40  # one request at a time
    forward_reps: int = 10  # forward-only batches of 16
    s2_requests: tuple[int, int, int] = (300, 100, 30)
    parity_images: int = 16


REHEARSAL = Sizes(images=32, sequential=4, forward_reps=2, s2_requests=(10, 5, 3), parity_images=4)
# The rehearsal's towers: the same families and processors, a sliver of their depth and width.
SHRINK = {
    "qwen2_5_vl_7b": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                      "out_hidden_size": 128, "fullatt_block_indexes": [0]},
    "siglip_so400m_384": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                          "num_attention_heads": 2},
}
TOWERS: dict[str, Callable[..., Path]] = {
    "qwen2_5_vl_7b": models.qwen25_vl_7b_vision_dir,
    "siglip_so400m_384": models.siglip_so400m_dir,
}


def _log(started: float, message: str) -> None:
    print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)


# -- the GPU as nvidia-smi sees it ----------------------------------------------------------------


class GpuSampler:
    """nvidia-smi read every ``period`` s in a thread: (time, utilization %, MiB used, {pid: MiB})."""

    def __init__(self, period: float = 0.2) -> None:
        self.available = shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, float, float, dict[int, float]]] = []
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _query(self, *args: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=5).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                gpu = self._query("--query-gpu=utilization.gpu,memory.used")[0]
                apps = {int(r[0]): float(r[1]) for r in self._query("--query-compute-apps=pid,used_memory")
                        if len(r) == 2 and r[0].isdigit() and _number(r[1])}
                self.samples.append((time.monotonic(), float(gpu[0]), float(gpu[1]), apps))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self._period)

    def utilization(self, windows: Sequence[tuple[float, float]]) -> float:
        inside = [s[1] for s in self.samples if any(a <= s[0] <= b for a, b in windows)]
        return statistics.fmean(inside) / 100 if inside else math.nan

    def peak_mb(self, pid: int, since: float, until: float) -> tuple[float, str]:
        """The process's peak MiB between two times, or the whole GPU's when nvidia-smi lists no
        processes (some virtualised drivers do not)."""
        window = [s for s in self.samples if since <= s[0] <= until]
        own = [s[3][pid] for s in window if pid in s[3]]
        if own:
            return max(own), "process"
        return (max(s[2] for s in window), "whole GPU") if window else (math.nan, "none")


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# -- one tower ------------------------------------------------------------------------------------


@contextmanager
def _server(*args: str, log_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(*args, log_dir=log_dir, timeout=300)
    try:
        yield server
    finally:
        server.stop()


def _forward_seconds(server: ServerProcess) -> float:
    conn = Conn(int(server.url.rsplit(":", 1)[1]))
    try:
        text = conn.get("/metrics")[1].decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith("encode_server_forward_seconds_sum "):
            return float(line.split()[1])
    return math.nan


def _burst(server: ServerProcess, images: Sequence[bytes]) -> float:
    port = int(server.url.rsplit(":", 1)[1])
    wall, _ = post_many(port, [Request("/v1/encode", json_body(d)) for d in images], CONCURRENCY)
    return wall


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def forward_only(bare: BarePipeline, images: Sequence[bytes], reps: int, device: str) -> dict[str, float]:
    """Images/s of the module's forward pass alone, and with the copy back and the bytes, over one
    batch of 16 preprocessed once on the device."""
    import torch

    encoder: Any = bare.encoder
    batch = [image_inputs(encoder, d, max_pixels=MAX_PIXELS) for d in images[:CONCURRENCY]]
    made, errors = encoder.batched.run([p.pending for p in batch])
    assert made is not None and not any(errors)
    inputs = {k: v.to(encoder.device, dtype=encoder.dtype if k == "pixel_values" else None) for k, v in made.items()}
    module_call = _module_call(encoder, inputs)
    timings: dict[str, list[float]] = {"module": [], "d2h": []}
    for rep in range(reps + 1):
        _sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            module_call()
        _sync(device)
        middle = time.perf_counter()
        encoder._forward(batch, inputs)
        ended = time.perf_counter()
        if rep:  # the first warms up
            timings["module"].append(middle - started)
            timings["d2h"].append(ended - middle)
    module = statistics.median(timings["module"])
    from bench.tower_ops import count  # what the pass dispatched on this device: ops, attention calls, syncs

    with torch.inference_mode():
        _, counts = count(module_call)
    return {"forward_only_images_per_s": len(batch) / module,
            "forward_d2h_images_per_s": len(batch) / statistics.median(timings["d2h"]),
            "forward_counts": {**counts.as_dict(), "ops_per_image": counts.ops / len(batch)}}


def _module_call(encoder: Any, inputs: dict[str, Any]) -> Callable[[], Any]:
    """The family's module call on prepared inputs, the output left on the device (a Qwen-style
    tower's with its grid plan made first, as ``_forward`` makes it: one attention call per layer,
    no host sync)."""
    if "image_grid_thw" in inputs:
        grids = [(int(t), int(h), int(w)) for t, h, w in inputs["image_grid_thw"].tolist()]  # before timing
        return lambda: encoder.tower_pass(inputs["pixel_values"], grids, inputs["image_grid_thw"])
    if "spatial_shapes" in inputs:
        return lambda: encoder.module(**inputs)
    return lambda: encoder._embed(inputs["pixel_values"])


def graphs(model: Path, device: str, dtype: str, images: Sequence[bytes], reps: int) -> dict[str, Any]:
    """A Qwen-style tower's ``forward`` eager and replayed from CUDA graphs (``--cuda-graphs``' default
    budgets), on one preprocessed batch of 16 and on a batch of one: median ms and the speedup."""
    from encode_server.encoders import load_encoder

    eager: Any = load_encoder(str(model), device=device, dtype=dtype)
    graphed: Any = load_encoder(str(model), device=device, dtype=dtype, cuda_graph_tokens=16384)
    line = graphed.capture_graphs()
    if graphed.graphs is None:
        return {"cuda_graphs": line or f"not used on {device} in {dtype}"}
    batch = [image_inputs(eager, d, max_pixels=MAX_PIXELS) for d in images]

    def median_s(encoder: Any, items: list[Any]) -> float:
        encoder.forward(items)
        times = []
        for _ in range(max(3, reps)):
            _sync(device)
            started = time.perf_counter()
            encoder.forward(items)
            _sync(device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    out: dict[str, Any] = {"cuda_graphs": line}
    for label, items in (("batch16", batch), ("batch1", batch[:1])):
        plain, replayed = median_s(eager, items), median_s(graphed, items)
        out[f"{label}_eager_ms"], out[f"{label}_graphs_ms"] = plain * 1e3, replayed * 1e3
        out[f"{label}_graphs_speedup"] = plain / replayed
    out["replays"], out["eager_packs"] = graphed.graphs.replays, graphed.graphs.eager
    return out


def parity(gpu_pre: BarePipeline, cpu_pre: BarePipeline, images: Sequence[bytes]) -> dict[str, float]:
    """The device path's embeddings against the CPU-preprocessing path's (same model, dtype, device)."""
    import torch

    def decode(e: Any) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(e.data), dtype=getattr(torch, e.dtype))
        return raw.reshape(e.shape).float()

    ours = gpu_pre.encoder.forward([image_inputs(gpu_pre.encoder, d, max_pixels=MAX_PIXELS) for d in images])
    theirs = cpu_pre.encoder.forward([image_inputs(cpu_pre.encoder, d, max_pixels=MAX_PIXELS) for d in images])
    rel, cos = [], []
    for a, b in zip(ours, theirs, strict=True):
        x, y = decode(a), decode(b)
        rel.append(((x - y).norm() / y.norm()).item())
        cos.append(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0).item())
    return {"embedding_rel_l2_max": max(rel), "embedding_rel_l2_median": statistics.median(rel),
            "cosine_min": min(cos)}


def tower(name: str, model: Path, sizes: Sizes, device: str, dtype: str, log_dir: Path, sampler: GpuSampler,
          seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    gpu_pre = BarePipeline(str(model), device, dtype, preprocess_device="model")
    cpu_pre = BarePipeline(str(model), device, dtype, preprocess_device="cpu")
    for bare in (gpu_pre, cpu_pre):
        bare.run(photos(seed + 90_000, 2))  # warm-up
    out: dict[str, Any] = {"model": str(model)}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out.update(forward_only(gpu_pre, photos(seed + 80_000, CONCURRENCY), sizes.forward_reps, device))
    out["parity"] = parity(gpu_pre, cpu_pre, photos(seed + 70_000, sizes.parity_images))
    log(f"{name}: forward-only and parity done")
    if hasattr(gpu_pre.encoder, "grid_plan"):  # a Qwen-style tower: with and without CUDA graphs
        try:
            out["graphs"] = graphs(model, device, dtype, photos(seed + 60_000, CONCURRENCY), sizes.forward_reps)
        except Exception as exc:  # the other figures still count
            traceback.print_exc()
            out["graphs"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        log(f"{name}: CUDA graphs {out['graphs']}")
    rounds = max(1, sizes.images // 64)
    per_round = sizes.images // rounds
    common = ["--model", str(model), "--device", device, "--dtype", dtype]
    rates: dict[str, list[float]] = {"bare": [], "bare_cpu_pre": [], "server": [], "server_cpu_pre": []}
    for pre in ("model", "cpu"):
        key = "server" if pre == "model" else "server_cpu_pre"
        with _server(*common, "--preprocess-device", pre, log_dir=log_dir) as server:
            started_at = time.monotonic()
            _burst(server, photos(seed + 50_000, CONCURRENCY))  # warm-up
            windows: list[tuple[float, float]] = []
            busy = 0.0
            for r in range(rounds):
                mine = photos(seed + 1000 * r + (pre == "cpu") * 500_000, per_round)
                theirs = photos(seed + 100_000 + 1000 * r + (pre == "cpu") * 500_000, per_round)
                bare = gpu_pre if pre == "model" else cpu_pre
                _sync(device)
                rates["bare" if pre == "model" else "bare_cpu_pre"].append(per_round / bare.burst(theirs))
                before, t0 = _forward_seconds(server), time.monotonic()
                wall = _burst(server, mine)
                windows.append((t0, time.monotonic()))
                busy += _forward_seconds(server) - before
                rates[key].append(per_round / wall)
            out[f"{key}_forward_busy_share"] = busy / sum(b - a for a, b in windows)
            out[f"{key}_nvidia_smi_utilization"] = sampler.utilization(windows)
            if pre == "model":
                out.update(_sequential(server, gpu_pre, sizes.sequential, seed + 200_000))
            _sync(device)
            peak, source = sampler.peak_mb(server.proc.pid, started_at, time.monotonic())
            out[f"{key}_peak_gpu_memory_mb"], out["peak_gpu_memory_source"] = peak, source
        log(f"{name}: server --preprocess-device {pre} done")
    out.update({f"{k}_images_per_s": statistics.median(v) for k, v in rates.items()})
    if cuda:
        out["bare_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    del gpu_pre, cpu_pre
    if cuda:
        torch.cuda.empty_cache()
    out["s1_ratio"] = out["server_images_per_s"] / out["bare_images_per_s"]
    out["s1_vs_forward_only"] = out["server_images_per_s"] / out["forward_only_images_per_s"]
    out["s1_overhead_ms"] = {"raw": out["server_raw_p50_ms"] - out["bare_batch1_ms"],
                             "json": out["server_json_p50_ms"] - out["bare_batch1_ms"]}
    out["gpu_over_cpu_preprocessing"] = {
        "server": out["server_images_per_s"] / out["server_cpu_pre_images_per_s"],
        "bare": out["bare_images_per_s"] / out["bare_cpu_pre_images_per_s"],
    }
    out["gpu_busy_share"] = {"nvidia_smi": out["server_nvidia_smi_utilization"],
                             "forward_thread": out["server_forward_busy_share"]}
    return out


def _sequential(server: ServerProcess, bare: BarePipeline, n: int, seed: int) -> dict[str, float]:
    """One request at a time, interleaved with the bare pipeline's batch of one."""
    conn = Conn(int(server.url.rsplit(":", 1)[1]))
    conn.post(Request("/v1/encode", json_body(photos(seed + 9_999, 1)[0])))
    bare_1, json_1, raw_1 = [], [], []
    for i in range(n):
        a, b, c = photos(seed + 3 * i, 3)
        bare_1.append(bare.run([a]))
        json_1.append(checked(conn, Request("/v1/encode", json_body(b))))
        raw_1.append(checked(conn, Request("/v1/encode", c, "image/jpeg")))
    conn.close()
    return {"bare_batch1_ms": 1000 * statistics.median(bare_1), "server_json_p50_ms": 1000 * statistics.median(json_1),
            "server_raw_p50_ms": 1000 * statistics.median(raw_1)}


# -- the run --------------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"gpu": gpu, "cpu_cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": tv, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run(sizes: Sizes, device: str, rehearsal: bool, out_path: Path) -> dict[str, Any]:
    started = time.perf_counter()
    log_dir = Path(tempfile.mkdtemp(prefix="encode-gpu-"))
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    result: dict[str, Any] = {"device": device, "rehearsal": rehearsal, "dtype": dtype, "machine": machine(device),
                              "sizes": asdict(sizes), "towers": {}, "errors": {}, "log_dir": str(log_dir)}

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        result["seconds"] = time.perf_counter() - started
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    def stage(name: str, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except Exception as exc:
            traceback.print_exc()
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            return None
        finally:
            save()

    log = lambda message: _log(started, message)  # noqa: E731
    dirs: dict[str, Path] = {}
    for name, build in TOWERS.items():
        built = stage(f"build {name}", lambda build=build, name=name: build(**(SHRINK[name] if rehearsal else {})))
        if built is not None:
            dirs[name] = built
            log(f"{name}: checkpoint at {built}")
    with GpuSampler() as sampler:
        result["nvidia_smi"] = sampler.available
        for seed, (name, model) in enumerate(dirs.items()):
            measured = stage(name, lambda name=name, model=model, seed=seed: tower(
                name, model, sizes, device, dtype, log_dir, sampler, 1_000_000 * (seed + 1), log))
            if measured is not None:
                result["towers"][name] = measured
    rounds = 1 if rehearsal else 2
    measured_ceiling = stage("ceiling", lambda: ceiling.run(
        "builtin:zero", sizes.images, rounds, log_dir, gil=ceiling.py_spy() is not None))
    if measured_ceiling is not None:
        result["ceiling"] = measured_ceiling
        log(f"ceiling done\n{ceiling.table(measured_ceiling)}")
    if "qwen2_5_vl_7b" in dirs:
        plan = Plan(s2_requests=sizes.s2_requests)
        two = stage("s2", lambda: s2(dirs["qwen2_5_vl_7b"], plan, log_dir,
                                     server_args=["--device", device, "--dtype", dtype]))
        if two is not None:
            result["s2"] = two
            result["s2_ratio_safetensors"] = min(two[f"safetensors_{n}"]["ratio"] for n in S2_TOKENS)
            result["s2_ratio_json"] = min(two[f"json_{n}"]["ratio"] for n in S2_TOKENS)
        log("S2 done")
    save()
    return result


# (figure, goal) per tower; the goals on an H200 (docs/benchmarks.md#gpu).
GOALS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "s1_ratio": (">= 0.95", lambda v: v >= 0.95),
    "s1_overhead_ms.raw": ("<= 2", lambda v: v <= 2),
    "s1_overhead_ms.json": ("<= 2", lambda v: v <= 2),
}
SIGLIP_GOALS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "s1_vs_forward_only": (">= 0.8", lambda v: v >= 0.8),
}
# The tower's own goals (one attention call per layer, no sync, CUDA graphs), on an H200.
QWEN_GOALS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "forward_only_images_per_s": (">= 120", lambda v: v >= 120),
    "graphs.batch1_graphs_speedup": (">= 1.1", lambda v: v >= 1.1),
}
ROWS = (
    "forward_only_images_per_s", "forward_d2h_images_per_s", "bare_images_per_s", "bare_cpu_pre_images_per_s",
    "server_images_per_s", "server_cpu_pre_images_per_s", "s1_ratio", "s1_vs_forward_only",
    "gpu_over_cpu_preprocessing.server", "gpu_over_cpu_preprocessing.bare", "bare_batch1_ms", "server_raw_p50_ms",
    "server_json_p50_ms", "s1_overhead_ms.raw", "s1_overhead_ms.json", "gpu_busy_share.nvidia_smi",
    "gpu_busy_share.forward_thread", "server_peak_gpu_memory_mb", "bare_peak_allocated_mb",
    "parity.embedding_rel_l2_max", "parity.cosine_min", "forward_counts.attention_calls", "forward_counts.syncs",
    "graphs.batch16_graphs_speedup", "graphs.batch1_graphs_speedup",
)


def _get(values: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(values, dict) or part not in values:
            return None
        values = values[part]
    return values


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table, one column per tower, each goal marked met or not."""
    names = list(result["towers"])
    lines = [f"| figure | {' | '.join(names)} | goal |", f"|---|{'---|' * len(names)}---|"]
    for row in ROWS:
        cells = []
        for name in names:
            value = _get(result["towers"][name], row)
            goal = (GOALS.get(row) or (SIGLIP_GOALS.get(row) if name.startswith("siglip") else None)
                    or (QWEN_GOALS.get(row) if name.startswith("qwen") else None))
            met = "" if goal is None or value is None else (" (met)" if goal[1](value) else " (not met)")
            cells.append("-" if value is None else f"{value:.3g}{met}")
        goal_text = GOALS[row][0] if row in GOALS else ""
        if row in SIGLIP_GOALS:
            goal_text = f"{SIGLIP_GOALS[row][0]} (SigLIP)"
        if row in QWEN_GOALS:
            goal_text = f"{QWEN_GOALS[row][0]} (Qwen)"
        lines.append(f"| {row} | {' | '.join(cells)} | {goal_text} |")
    for key, goal_text in (("s2_ratio_safetensors", ">= 0.8"), ("s2_ratio_json", "")):
        if key in result:
            lines.append(f"| {key} | {result[key]:.3g} |{' - |' * (len(names) - 1)} {goal_text} |")
    if "ceiling" in result:
        heading = "The serving path's ceiling (builtin:zero, concurrency 16):"
        lines += ["", heading, "", ceiling.table(result["ceiling"])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rehearsal", action="store_true", help="shrunken towers and few images (off the GPU)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch sees no CUDA device: run with --device cpu --rehearsal off the GPU", file=sys.stderr)
        return 2
    tune_allocator()
    result = run(REHEARSAL if args.rehearsal else Sizes(), args.device, args.rehearsal, args.out)
    text = table(result)
    gpu = result["machine"]["gpu"] or f"{args.device} (rehearsal)"
    heading = f"{gpu}, {result['dtype']}, {result['seconds']:.0f} s, torch {result['machine']['torch']}"
    args.out.with_suffix(".md").write_text(f"{heading}\n\n{text}\n")
    print(f"\n{heading}\n{text}\nwrote {args.out} and {args.out.with_suffix('.md')}")
    for stage_name, error in result["errors"].items():
        print(f"stage {stage_name} failed: {error}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
