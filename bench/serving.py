"""Serving overhead, measured side by side in one run: encode-server against the bare model and the raw wire.

Every figure is a ratio or a difference taken in the same run on the same machine, so the noise
of a shared machine cancels as far as it can. Real server processes on 127.0.0.1, real Redis (our
own ``redis-server`` on a free port), models built from configs (``bench/models.py``), photo-like
640x480 JPEGs (``bench/workload.py``). Bounded everywhere: request counts, concurrency 16, timeouts.

Keys written to ``bench/results/latest.json`` (``--out``), one per figure:

- ``s1_ratio`` / ``s1_ratio_tiny``: unique images at concurrency 16 (JSON base64 uploads), server
  img/s over the in-process batched pipeline (decode + preprocess + forward, batches of 16) of the
  same model: ViT-B/32-sized CLIP tower and the built-in tiny tower.
- ``s1_overhead_ms`` / ``s1_overhead_ms_vitb32`` / ``s1_overhead_ms_clip_pooled`` /
  ``s1_overhead_ms_qwen25vl``: ``{"raw": ms, "json": ms}``, one request at a time: the median over
  triples (in-process batch-1 pipeline, server JSON, server raw; 96-120 of them, in rotating order)
  of server minus pipeline within the triple (``paired_overhead``; its 95% interval is in
  ``detail``): the tiny tower, the ViT-B/32-sized one, a tiny CLIP served ``--output pooled``, the
  Qwen2.5-VL tower.
- ``s1_tail_c16``: per model, p99 over p50 of unique images under steady load at concurrency 16
  (a closed loop, 400 requests kept after the ramp, 240 for the two large towers, ``steady_tail``);
  ``s1_burst_tail_c16``: the same ratio over the throughput rounds' bursts from idle, kept beside
  it (no goal: its p99 is the whole burst's work, its p50 lower the sooner a server answers the
  first of 16 simultaneous requests, ``steady_tail``).
- ``s2_ratio_safetensors`` / ``s2_ratio_json``: hash-only hits of 64, 576 and 2,500 tokens x 1,024
  float32 (one request at a time, one connection): GB/s of embedding over the GB/s of a minimal
  asyncio server (``bench/rawhttp.py``) answering the same bytes. The key holds the lowest of the
  three sizes; ``s2_by_tokens`` has each.
- ``upload_hit_overhead_ms``: p50 of a local hit uploaded as JSON base64 minus the same hit uploaded
  as the raw body (``Content-Type: image/jpeg``).
- ``s3_speedup`` / ``s3_hit_rate``: Zipf(1.0) over 2,000 images, 10,000 requests at concurrency 16
  through ``encode_client.AsyncClient`` (its default upload mode), local tier at 20% of the working
  set backed by Redis, over the same sequence with the cache turned off (``--cache-mb 0``, no Redis;
  every request an encode, so its rate is measured on the first ``s3_off_requests`` of the sequence).
- ``s4_redis_vs_local``: p50 of a local hit, a Redis hit and a fresh encode (``bench/tiers.py``).
- ``s5_upload_bytes_ratio``: image bytes the client sent in S3 over the bytes always-upload sends.
- ``hashfirst_allmiss_ratio``: all-miss traffic, client default mode img/s over ``upload="always"``.
- ``rss_peak_mb``: each server's peak RSS (VmHWM) at the end of its scenario.

Run: ``make bench`` (full, a few minutes on 2 cores) or ``python -m bench.serving --quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# First, before anything loads torch: the bare pipeline must run in the process state the server
# runs in (encode_server.encoders sets OMP_WAIT_POLICY before torch loads its OpenMP runtime;
# main() tunes glibc's allocator as the server's first step does).
import encode_server.encoders  # noqa: F401
from bench import models
from bench.latest import RESULTS, merge_into
from bench.rawhttp import Conn, Request, exchange, post_many
from bench.vllm_peer import TOWER as VLLM_PEER_TOWER
from bench.workload import photos, zipf_sequence
from encode_server.kinds import image_inputs
from encode_server.malloc import tune_allocator
from tests.redis_procs import start_redis
from tests.server import ServerProcess, free_port, start_server

SAFETENSORS = "application/vnd.safetensors"
MAX_PIXELS = 40_000_000
CONCURRENCY = 16
S2_TOKENS = (64, 576, 2500)


@dataclass(frozen=True)
class Plan:
    """Request counts: the full run and ``--quick`` (the test's: it checks the keys, not the speed)."""

    s1_images: int = 128
    s1_vit_images: int = 64
    sequential: int = 120
    sequential_vit: int = 96
    s1_tail: int = 400
    s1_tail_vit: int = 240
    s2_requests: tuple[int, int, int] = (300, 100, 30)
    s3_images: int = 2000
    s3_requests: int = 10_000
    s3_off_requests: int = 800
    allmiss_images: int = 192
    s4_rounds: int = 10


QUICK = Plan(
    s1_images=16, s1_vit_images=8, sequential=5, sequential_vit=3, s1_tail=8, s1_tail_vit=8, s2_requests=(10, 5, 3),
    s3_images=60, s3_requests=240, s3_off_requests=48, allmiss_images=32, s4_rounds=2,
)
QUICK_VIT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
# bench/vllm_peer.py's Qwen2.5-VL tower (the one raced against vLLM's E), its rows 64 wide as there.
QWEN_TOWER = {**VLLM_PEER_TOWER, "out_hidden_size": 64}
QUICK_QWEN = {**QWEN_TOWER, "depth": 2, "fullatt_block_indexes": [1]}


def p50_ms(xs: Sequence[float]) -> float:
    return 1000 * statistics.median(xs)


def peak_rss_mb(server: ServerProcess) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def json_body(data: bytes) -> bytes:
    return json.dumps({"items": [{"data": base64.b64encode(data).decode("ascii")}]}).encode()


def port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


@contextmanager
def running(*args: str, log_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(*args, log_dir=log_dir, timeout=300)
    try:
        yield server
    finally:
        server.stop()


# -- S1: the bare pipeline against the server -----------------------------------------------------


class BarePipeline:
    """The same model in this process: decode + preprocess + forward, no server, torch's own
    threads. Its batches are of 16, as the server's concurrency is. ``preprocess_device`` as the
    server's flag: ``model`` decodes and preprocesses each batch on the device."""

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", preprocess_device: str = "cpu",
                 output: str = "hidden") -> None:
        from encode_server.encoders import load_encoder

        self.encoder = load_encoder(model, device=device, dtype=dtype, preprocess_device=preprocess_device,
                                    output=output)
        self._sync = _cuda_sync if device.startswith("cuda") else (lambda: None)

    def run(self, chunk: Sequence[bytes]) -> float:
        started = time.perf_counter()
        prepared = [image_inputs(self.encoder, d, max_pixels=MAX_PIXELS) for d in chunk]
        self.encoder.forward(prepared)  # returns host bytes: the device work is done
        self._sync()
        return time.perf_counter() - started

    def burst(self, images: Sequence[bytes]) -> float:
        return sum(self.run(images[i : i + CONCURRENCY]) for i in range(0, len(images), CONCURRENCY))


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def s1(model: str, server_args: Sequence[str], n_images: int, n_seq: int, seed: int, log_dir: Path,
       extra: Callable[[ServerProcess], dict[str, Any]] | None = None, device: str = "cpu",
       dtype: str = "float32", output: str = "hidden", n_tail: int = 400) -> dict[str, Any]:
    """Interleaved, so that the load of a shared machine falls on both sides alike: rounds of
    (bare burst, server burst) for the throughput; then the tail under steady load (``steady_tail``,
    ``n_tail`` requests kept); then one request at a time, ``n_seq`` triples of (bare, server JSON,
    server raw) in an order that rotates, for the overhead (``paired_overhead``)."""
    rounds = max(1, n_images // 32)
    per_round = n_images // rounds
    bare = BarePipeline(model, device, dtype, output=output)
    bare.run(photos(seed + 60_000, 2))  # warm-up
    bare_rates, server_rates, server_c16 = [], [], []
    with running(*server_args, log_dir=log_dir) as server:
        port = port_of(server)
        warm = photos(seed + 50_000, CONCURRENCY)
        post_many(port, [Request("/v1/encode", json_body(d)) for d in warm], CONCURRENCY)
        for r in range(rounds):
            ours = photos(seed + 1000 * r, per_round)
            theirs = photos(seed + 100_000 + 1000 * r, per_round)
            bare_rates.append(per_round / bare.burst(theirs))
            wall, latencies = post_many(port, [Request("/v1/encode", json_body(d)) for d in ours], CONCURRENCY)
            server_rates.append(per_round / wall)
            server_c16.extend(latencies)
        foreign: dict[str, float] = {}
        with foreign_cpu(server, foreign, "steady"):
            steady = steady_tail(port, photos(seed + 80_000, n_tail + STEADY_SKIP + CONCURRENCY))
        conn = Conn(port)
        conn.post(Request("/v1/encode", json_body(photos(seed + 70_000, 1)[0])))
        times: dict[str, list[float]] = {"bare": [], "json": [], "raw": []}
        with foreign_cpu(server, foreign, "sequential"):
            for i in range(n_seq):
                a, b, c = photos(seed + 200_000 + 3 * i, 3)
                steps = (
                    ("bare", lambda a=a, run=bare.run: run([a])),
                    ("json", lambda b=b: checked(conn, Request("/v1/encode", json_body(b)))),
                    ("raw", lambda c=c: checked(conn, Request("/v1/encode", c, "image/jpeg"))),
                )
                for name, step in steps[i % 3 :] + steps[: i % 3]:  # each goes first, second, third alike
                    times[name].append(step())
        conn.close()
        paired = {kind: paired_overhead(times[kind], times["bare"]) for kind in ("raw", "json")}
        out = {
            "server_images_per_s": statistics.median(server_rates),
            "bare_images_per_s": statistics.median(bare_rates),
            "bare_batch1_ms": p50_ms(times["bare"]),
            "server_json_p50_ms": p50_ms(times["json"]),
            "server_raw_p50_ms": p50_ms(times["raw"]),
            # one request at a time: the median of the per-triple differences, and its 95% interval
            "overhead_ms": {kind: est for kind, (est, _, _) in paired.items()},
            "overhead_ci95_ms": {kind: [lo, hi] for kind, (_, lo, hi) in paired.items()},
            "sequential_triples": n_seq,
            # 16 connections in a closed loop, the ramp and the drain left out: the tail of steady load
            **steady,
            # each request's latency in the throughput rounds: bursts of 16 on an idle server (the
            # bare pipeline runs between them), kept to be read beside the steady tail, not as it
            "server_burst_p50_ms": p50_ms(server_c16),
            "server_burst_p99_ms": 1000 * statistics.quantiles(server_c16, n=100, method="inclusive")[98],
            "rounds": rounds,
            # CPU cores other processes used meanwhile (a shared machine's load beside each figure)
            "foreign_cpu_cores": foreign,
        }
        del bare
        gc.collect()
        if extra is not None:
            out.update(extra(server))
        out["rss_peak_mb"] = peak_rss_mb(server)
    return out


@contextmanager
def foreign_cpu(server: ServerProcess, into: dict[str, float], key: str) -> Iterator[None]:
    """``into[key]``: the CPU cores, on average, that processes other than this one and ``server``
    used while the block ran (/proc/stat's busy time, all but idle and iowait, less both processes'
    own): the load of a shared machine beside a figure, which the load average (this run's own
    threads included) does not tell apart."""

    def busy() -> float:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def own() -> float:
        t = os.times()
        return t.user + t.system + process_cpu_seconds(server.proc.pid)

    started, busy0, own0 = time.perf_counter(), busy(), own()
    try:
        yield
    finally:
        into[key] = max(0.0, (busy() - busy0) - (own() - own0)) / (time.perf_counter() - started)


STEADY_SKIP = 2 * CONCURRENCY  # the ramp: the first 16 meet an idle server, the next 16 their wake


def closed_loop(port: int, requests: Sequence[Request], concurrency: int, timeout: float = 120.0) -> list[float]:
    """``concurrency`` keep-alive connections, each sending the next request the moment its last is
    answered, in the order given: each request's latency, in that order (the i-th sent is the i-th)."""

    async def run() -> list[float]:
        pending = deque(enumerate(requests))
        latencies = [0.0] * len(requests)

        async def worker() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while pending:
                    i, req = pending.popleft()
                    started = time.perf_counter()
                    status, body = await asyncio.wait_for(exchange(reader, writer, req), timeout)
                    latencies[i] = time.perf_counter() - started
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
            finally:
                writer.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies

    return asyncio.run(run())


def steady_tail(port: int, images: Sequence[bytes]) -> dict[str, float]:
    """The tail as an operator means it: p50 and p99 of unique images (JSON base64) under steady load
    at concurrency 16, over every request but the first ``STEADY_SKIP`` sent (the ramp from idle)
    and the last 16 (the drain, where fewer than 16 are in flight).

    Not the throughput rounds' own latencies (``s1_burst_tail_c16``, kept beside it): there, each
    round is 32 requests at concurrency 16 on an idle server (the bare pipeline runs between rounds),
    so half of them are 16 sent at once. The last of those is answered only once all 16 are encoded
    (its latency is the whole burst's work), the first after one pass: their p99 is bounded by the
    burst's work whatever the batcher does, and their p50 is lower the sooner the first answers go
    out. A server that held every answer to the end would score 1.0 with the same p99 and a worse
    p50. Measured with a per-request timeline (docs/benchmark-history.md, the c16 tails): on the built-in tower
    the 9th-16th of the 16 sent at once took 2.4x the 1st-8th (waiting behind them for the two
    decode threads); on the Qwen2.5-VL tower the first two rode alone, and the other 14 split 7 / 4 /
    3 as the passes freed, the 7 being the p99. And 64 or 128 samples put p99 at the largest or
    second largest value of a run, one slow moment of a shared machine.
    """
    requests = [Request("/v1/encode", json_body(d)) for d in images]
    latencies = closed_loop(port, requests, CONCURRENCY)[STEADY_SKIP : len(requests) - CONCURRENCY]
    return {
        "server_c16_p50_ms": p50_ms(latencies),
        "server_c16_p99_ms": 1000 * statistics.quantiles(latencies, n=100, method="inclusive")[98],
        "server_c16_requests": len(latencies),
    }


def paired_overhead(server: Sequence[float], bare: Sequence[float]) -> tuple[float, float, float]:
    """One request at a time: the median of the per-triple differences (server minus the bare
    pipeline timed beside it, ms) and its 95% distribution-free interval (order statistics). Paired,
    so that a slow moment of a shared machine falls on both terms of a difference, where the
    difference of two medians adds both sides' noise. Measured on the ViT-B/32-sized CLIP (150
    triples, a ~100 ms pass on a shared machine), over blocks of 24 triples: the difference of
    medians spread -7.1..3.9 ms (sd 2.6), the median of the paired differences 0.5..4.7 (sd 0.9);
    over blocks of 96, 0.8..2.0 against 2.1..2.5."""
    diffs = sorted(1000 * (s - b) for s, b in zip(server, bare, strict=True))
    n = len(diffs)
    k = max(0, math.floor((n - 1.96 * math.sqrt(n)) / 2))  # ranks k and n-1-k bound the median at 95%
    return statistics.median(diffs), diffs[k], diffs[n - 1 - k]


def tail(s1_result: dict[str, Any]) -> float:
    """Unique images under steady load at concurrency 16: the server's p99 latency over its p50."""
    return s1_result["server_c16_p99_ms"] / s1_result["server_c16_p50_ms"]


def burst_tail(s1_result: dict[str, Any]) -> float:
    """The same ratio over the throughput rounds' bursts from idle (``steady_tail`` says why it is
    not the goal's figure)."""
    return s1_result["server_burst_p99_ms"] / s1_result["server_burst_p50_ms"]


def overhead(s1_result: dict[str, Any]) -> dict[str, float]:
    """One request at a time, raw body and JSON: the median of server minus bare pipeline, per
    triple (``paired_overhead``)."""
    return dict(s1_result["overhead_ms"])


def hit_costs(server: ServerProcess, n: int, seed: int) -> dict[str, float]:
    """One request at a time, interleaved, all hits on the local tier: JSON base64 upload, raw
    upload, hash only; and ``/health`` as the floor of an HTTP round trip through this server."""
    from blake3 import blake3

    data = photos(seed, 1)[0]
    conn = Conn(port_of(server))
    raw = Request("/v1/encode", data, "image/jpeg")
    as_json = Request("/v1/encode", json_body(data))
    hashed = Request("/v1/encode", json.dumps({"items": [{"hash": blake3(data).hexdigest()}]}).encode())
    checked(conn, raw)  # encode it once
    times: dict[str, list[float]] = {"json": [], "raw": [], "hash": [], "health": []}
    for i in range(n + 1):
        t_json, t_raw, t_hash = checked(conn, as_json), checked(conn, raw), checked(conn, hashed)
        t = time.perf_counter()
        conn.get("/health")
        t_health = time.perf_counter() - t
        if i:  # the first round warms up
            for key, took in zip(times, (t_json, t_raw, t_hash, t_health), strict=True):
                times[key].append(took)
    conn.close()
    return {
        "hit_json_p50_ms": p50_ms(times["json"]), "hit_raw_p50_ms": p50_ms(times["raw"]),
        "hit_hash_p50_ms": p50_ms(times["hash"]), "health_p50_ms": p50_ms(times["health"]),
        "hit_json_body_bytes": len(as_json.body),
    }


def checked(conn: Conn, req: Request) -> float:
    status, body, took = conn.post(req)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    return took


def allmiss(server: ServerProcess, n: int, seed: int) -> dict[str, float]:
    """All-miss traffic through ``encode_client.AsyncClient``: its default mode against ``always``,
    in rounds that alternate which goes first, so that neither side always runs right after the
    other's tail (each mode keeps its client, so the default mode's window carries over)."""
    from encode_client import AsyncClient

    async def run() -> dict[str, float]:
        rounds = max(2, min(6, n // CONCURRENCY))
        per_round = max(CONCURRENCY, n // rounds)
        took = {"default": 0.0, "always": 0.0}
        async with AsyncClient(server.url) as default, AsyncClient(server.url, upload="always") as always:
            for r in range(rounds):
                order = (("default", default), ("always", always))
                for name, client in order if r % 2 == 0 else order[::-1]:
                    queue = photos(seed + 10_000 * r + (name == "always") * 5_000, per_round)

                    async def worker(client: AsyncClient = client, queue: list[bytes] = queue) -> None:
                        while queue:
                            await client.encode([queue.pop()])

                    started = time.perf_counter()
                    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
                    took[name] += time.perf_counter() - started
            stats = asdict(default.stats)
        images = rounds * per_round
        return {"default_images_per_s": images / took["default"], "always_images_per_s": images / took["always"],
                "default_client_stats": stats}

    return asyncio.run(run())


# -- S2: hits against the raw wire ----------------------------------------------------------------


def s2(model_dir: Path, plan: Plan, log_dir: Path, server_args: Sequence[str] = ()) -> dict[str, Any]:
    import numpy as np
    import redis as redis_lib

    from encode_server.core.stored import encode_value
    from encode_server.core.types import Embedding, EncodedTensor

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    with start_redis() as redis, running(
        "--model", str(model_dir), "--redis-url", redis.url, "--cache-prefix", prefix, *server_args, log_dir=log_dir
    ) as server:
        port = port_of(server)
        conn = Conn(port)
        info = json.loads(conn.get("/v1/model")[1])
        fingerprint, dim, dtype = info["fingerprint"], int(info["hidden_size"]), info["dtype"]
        itemsize = 4 if dtype == "float32" else 2
        client = redis_lib.Redis.from_url(redis.url)
        hashes = {}
        for n in S2_TOKENS:
            h = uuid.uuid4().hex + uuid.uuid4().hex
            tensor = rng.standard_normal((n, dim), dtype=np.float32)
            raw = tensor.tobytes() if itemsize == 4 else (tensor.view(np.uint32) >> 16).astype("<u2").tobytes()
            value = Embedding(EncodedTensor(raw, (n, dim), dtype), {})
            client.set(f"{prefix}:v1:{fingerprint}:{h}", encode_value(fingerprint, h, value))
            hashes[n] = h
        client.close()
        answers = Path(tempfile.mkdtemp(prefix="encode-bench-raw-"))
        requests: dict[tuple[int, str], Request] = {}
        for n, h in hashes.items():
            body = json.dumps({"items": [{"hash": h}]}).encode()
            for fmt, accept in (("safetensors", SAFETENSORS), ("json", "application/json")):
                req = Request("/v1/encode", body, accept=accept)
                status, answer, _ = conn.post(req)  # the first pulls it from Redis into the local tier
                if status != 200 or not _all_hits(fmt, answer):
                    raise RuntimeError(f"S2 set-up: not a hit ({status}): {answer[:300]!r}")
                (answers / f"{fmt}-{n}").write_bytes(answer)
                requests[(n, fmt)] = req
        conn.close()
        raw_port = free_port()
        raw = subprocess.Popen([sys.executable, "-m", "bench.rawhttp", "serve", str(answers), str(raw_port)])
        try:
            _wait_port(raw_port)
            for (n, fmt), req in requests.items():
                count = plan.s2_requests[S2_TOKENS.index(n)]
                gb = n * dim * itemsize * count / 1e9
                ours, ours_cpu = _repeat(port, req, count, server.proc.pid)
                wire, wire_cpu = _repeat(raw_port, Request(f"/{fmt}-{n}", req.body, accept=req.accept), count, raw.pid)
                out[f"{fmt}_{n}"] = {
                    "server_gb_s": gb / ours, "raw_gb_s": gb / wire, "ratio": wire / ours,
                    # CPU per request (ms) of each server process: far less load-sensitive than the wall ratio
                    "server_cpu_ms": 1000 * ours_cpu / count, "raw_cpu_ms": 1000 * wire_cpu / count,
                }
        finally:
            raw.terminate()
            raw.wait(10)
            shutil.rmtree(answers, ignore_errors=True)
        out["rss_peak_mb"] = peak_rss_mb(server)
        out["hidden_size"], out["dtype"] = dim, dtype
    return out


def _all_hits(fmt: str, answer: bytes) -> bool:
    """Every item of an answer is a hit: read from its JSON, or from the safetensors header's
    metadata (not by searching the bytes, whose base64 or raw floats can spell anything)."""
    if fmt == "json":
        return all(item["status"] == "hit" for item in json.loads(answer)["items"])
    length = int.from_bytes(answer[:8], "little")
    items = json.loads(json.loads(answer[8 : 8 + length])["__metadata__"]["items"])
    return all(item["status"] == "hit" for item in items)


def _wait_port(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _repeat(port: int, req: Request, count: int, pid: int) -> tuple[float, float]:
    """Seconds for ``count`` sequential requests on one connection (after one warm-up), and the
    CPU seconds the server process ``pid`` spent meanwhile."""
    conn = Conn(port)
    try:
        conn.post(req)
        cpu = process_cpu_seconds(pid)
        started = time.perf_counter()
        for _ in range(count):
            status, _, _ = conn.post(req)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
        return time.perf_counter() - started, process_cpu_seconds(pid) - cpu
    finally:
        conn.close()


def process_cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc; with ``children``,
    of its live descendants too (``--preprocess-processes`` workers)."""
    def cpu(stat: list[str]) -> float:
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    total = cpu(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split())
    if children:
        stats: dict[int, list[str]] = {}
        for path in Path("/proc").glob("[0-9]*/stat"):
            try:
                stats[int(path.parent.name)] = path.read_text().rsplit(")", 1)[1].split()
            except (OSError, ValueError):  # gone meanwhile
                continue
        family, grew = {pid}, True
        while grew:
            more = {p for p, stat in stats.items() if int(stat[1]) in family} - family
            family |= more
            grew = bool(more)
        total += sum(cpu(stats[p]) for p in family - {pid})
    return total


# -- S3 / S5: a popular-image mix through the client ----------------------------------------------


def s3(plan: Plan, log_dir: Path, embedding_bytes: int) -> dict[str, Any]:
    images = photos(7_000_000, plan.s3_images)
    sequence = zipf_sequence(plan.s3_images, plan.s3_requests, 1.0, seed=1)
    working_set = len(set(sequence)) * embedding_bytes
    cache_mb = max(1.0, 0.2 * working_set / (1 << 20))
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    from tests.integration.conftest import start_servers

    with start_redis() as redis:
        on_args = ["--cache-mb", f"{cache_mb:.2f}", "--redis-url", redis.url, "--cache-prefix", prefix]
        cache_on, cache_off = start_servers(on_args, ["--cache-mb", "0"], log_dir=log_dir)
        try:
            # Off first: the on server then meets the same machine state as late as possible.
            off = _client_mix(cache_off, images, sequence[: plan.s3_off_requests])
            off["rss_peak_mb"] = peak_rss_mb(cache_off)
            on = _client_mix(cache_on, images, sequence)
            on["rss_peak_mb"] = peak_rss_mb(cache_on)
            on["hit_rate"] = _hit_rate(cache_on)
        finally:
            cache_on.stop()
            cache_off.stop()
    sent_always = sum(len(images[i]) for i in sequence)
    return {
        "cache_mb": cache_mb, "working_set_mb": working_set / (1 << 20), "on": on, "off": off,
        "speedup": on["requests_per_s"] / off["requests_per_s"],
        "upload_bytes_ratio": on["upload_bytes"] / sent_always,
    }


def _client_mix(server: ServerProcess, images: list[bytes], sequence: list[int]) -> dict[str, Any]:
    from encode_client import AsyncClient

    async def run() -> dict[str, Any]:
        async with AsyncClient(server.url) as client:
            queue = list(reversed(sequence))

            async def worker() -> None:
                while queue:
                    await client.encode([images[queue.pop()]])

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            took = time.perf_counter() - started
            stats = getattr(client, "stats", None)
            return {"requests_per_s": len(sequence) / took, "seconds": took,
                    "client_stats": asdict(stats) if stats is not None else {}}

    before = _metric(server, "encode_server_upload_bytes_total")
    out = asyncio.run(run())
    out["upload_bytes"] = _metric(server, "encode_server_upload_bytes_total") - before
    return out


def _metrics_text(server: ServerProcess) -> str:
    conn = Conn(port_of(server))
    try:
        return conn.get("/metrics")[1].decode()
    finally:
        conn.close()


def _metric(server: ServerProcess, name: str) -> float:
    """The value of an unlabelled counter or gauge."""
    for line in _metrics_text(server).splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _hit_rate(server: ServerProcess) -> float:
    text = _metrics_text(server)
    hits = enc = 0.0
    for line in text.splitlines():
        if line.startswith("encode_server_items_total{"):
            value = float(line.rsplit(" ", 1)[1])
            if 'status="hit"' in line:
                hits += value
            elif 'status="encoded"' in line:
                enc += value
    return hits / (hits + enc) if hits + enc else float("nan")


# -- S4 -------------------------------------------------------------------------------------------


def s4(rounds: int, log_dir: Path) -> dict[str, float]:
    from bench.tiers import http_tiers
    from tests.integration.conftest import start_servers

    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    with start_redis() as redis:
        common = ["--redis-url", redis.url, "--cache-prefix", prefix, "--max-items", "64"]
        local, remote = start_servers(common, [*common, "--cache-mb", "0"], log_dir=log_dir)
        try:
            times = http_tiers(local, remote, redis, prefix, rounds)
            rss = max(peak_rss_mb(local), peak_rss_mb(remote))
        finally:
            local.stop()
            remote.stop()
    return {
        "local_hit_p50_ms": p50_ms(times["local"]), "redis_hit_p50_ms": p50_ms(times["redis"]),
        "encode_p50_ms": p50_ms(times["encode"]), "rss_peak_mb": rss,
    }


# -- the run --------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu, "cores": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def run(plan: Plan, quick: bool) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="encode-bench-"))
    started = time.perf_counter()
    if quick:
        models.CONFIGS["vitb32-quick"] = {**models.CONFIGS["vitb32"], **QUICK_VIT}
    vit_dir = models.model_dir("vitb32-quick" if quick else "vitb32")
    wide_dir = models.model_dir("wide")
    result: dict[str, Any] = {"machine": machine(), "quick": quick, "plan": asdict(plan)}
    detail: dict[str, Any] = {}

    def tiny_extra(server: ServerProcess) -> dict[str, Any]:
        out = hit_costs(server, plan.sequential, seed=900_000)
        out.update(allmiss(server, plan.allmiss_images, seed=1_000_000))
        return out

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)

    log("S1 tiny (built-in model)")
    detail["s1_tiny"] = tiny = s1("builtin:tiny", [], plan.s1_images, plan.sequential, 100_000, log_dir, tiny_extra,
                                  n_tail=plan.s1_tail)
    log("S1 ViT-B/32-sized CLIP tower")
    detail["s1_vitb32"] = vit = s1(
        str(vit_dir), ["--model", str(vit_dir)], plan.s1_vit_images, plan.sequential_vit, 200_000, log_dir,
        n_tail=plan.s1_tail_vit,
    )
    log("S1 tiny CLIP, pooled output")
    clip_dir = models.model_dir("clip")
    detail["s1_clip_pooled"] = clip = s1(
        str(clip_dir), ["--model", str(clip_dir), "--output", "pooled"], plan.s1_vit_images, plan.sequential,
        300_000, log_dir, output="pooled", n_tail=plan.s1_tail,
    )
    log("S1 Qwen2.5-VL tower (bench/vllm_peer.py's)")
    qwen_dir = models.qwen25_vl_7b_vision_dir(**(QUICK_QWEN if quick else QWEN_TOWER))
    detail["s1_qwen25vl"] = qwen = s1(
        str(qwen_dir), ["--model", str(qwen_dir), "--dtype", "float32"], plan.s1_vit_images, plan.sequential_vit,
        400_000, log_dir, n_tail=plan.s1_tail_vit,
    )
    log("S2 hash-only hits against the raw wire")
    detail["s2"] = two = s2(wide_dir, plan, log_dir)
    log("S3/S5 Zipf mix through the client")
    embedding_bytes = _tiny_embedding_bytes()
    detail["s3"] = three = s3(plan, log_dir, embedding_bytes)
    log("S4 tiers")
    detail["s4"] = four = s4(plan.s4_rounds, log_dir)
    log("done")

    result.update(
        s1_ratio=vit["server_images_per_s"] / vit["bare_images_per_s"],
        s1_ratio_tiny=tiny["server_images_per_s"] / tiny["bare_images_per_s"],
        s1_ratio_clip_pooled=clip["server_images_per_s"] / clip["bare_images_per_s"],
        s1_ratio_qwen25vl=qwen["server_images_per_s"] / qwen["bare_images_per_s"],
        s1_overhead_ms=overhead(tiny),
        s1_overhead_ms_vitb32=overhead(vit),
        s1_overhead_ms_clip_pooled=overhead(clip),
        s1_overhead_ms_qwen25vl=overhead(qwen),
        s1_tail_c16=dict(zip(S1_MODELS, map(tail, (tiny, vit, clip, qwen)), strict=True)),
        s1_burst_tail_c16=dict(zip(S1_MODELS, map(burst_tail, (tiny, vit, clip, qwen)), strict=True)),
        s2_ratio_safetensors=min(two[f"safetensors_{n}"]["ratio"] for n in S2_TOKENS),
        s2_ratio_json=min(two[f"json_{n}"]["ratio"] for n in S2_TOKENS),
        s2_by_tokens={str(n): {f: two[f"{f}_{n}"]["ratio"] for f in ("safetensors", "json")} for n in S2_TOKENS},
        upload_hit_overhead_ms=tiny["hit_json_p50_ms"] - tiny["hit_raw_p50_ms"],
        s3_speedup=three["speedup"],
        s3_hit_rate=three["on"]["hit_rate"],
        s4_redis_vs_local={
            "local_ms": four["local_hit_p50_ms"], "redis_ms": four["redis_hit_p50_ms"],
            "encode_ms": four["encode_p50_ms"], "redis_over_local": four["redis_hit_p50_ms"] / four["local_hit_p50_ms"],
        },
        s5_upload_bytes_ratio=three["upload_bytes_ratio"],
        hashfirst_allmiss_ratio=tiny["default_images_per_s"] / tiny["always_images_per_s"],
        rss_peak_mb={
            "s1_tiny": tiny["rss_peak_mb"], "s1_vitb32": vit["rss_peak_mb"], "s1_qwen25vl": qwen["rss_peak_mb"],
            "s2": two["rss_peak_mb"],
            "s3_cache_on": three["on"]["rss_peak_mb"], "s3_cache_off": three["off"]["rss_peak_mb"],
            "s4": four["rss_peak_mb"],
        },
        seconds=time.perf_counter() - started,
        load_avg_at_end=os.getloadavg()[0],
        detail=detail,
    )
    shutil.rmtree(log_dir, ignore_errors=True)
    return result


def _tiny_embedding_bytes() -> int:
    """Bytes of one 640x480 image's embedding from the built-in model (sizes the S3 cache)."""
    from encode_server.encoders import load_encoder

    encoder = load_encoder("builtin:tiny", device="cpu", dtype="float32")
    num_tokens, _ = encoder.count_tokens(640, 480)
    return num_tokens * encoder.info.hidden_size * 4


KEYS = (
    "s1_ratio", "s1_ratio_tiny", "s1_ratio_clip_pooled", "s1_ratio_qwen25vl", "s1_overhead_ms",
    "s1_overhead_ms_vitb32", "s1_overhead_ms_clip_pooled", "s1_overhead_ms_qwen25vl", "s1_tail_c16",
    "s1_burst_tail_c16",
    "s2_ratio_safetensors", "s2_ratio_json",
    "upload_hit_overhead_ms", "s3_speedup", "s3_hit_rate", "s4_redis_vs_local", "s5_upload_bytes_ratio",
    "hashfirst_allmiss_ratio", "rss_peak_mb",
)
S1_MODELS = ("tiny", "vitb32", "clip_pooled", "qwen25vl")  # s1_tail_c16's and s1_burst_tail_c16's keys
OVERHEAD_KEYS = ("s1_overhead_ms", "s1_overhead_ms_vitb32", "s1_overhead_ms_clip_pooled", "s1_overhead_ms_qwen25vl")
# (figure, goal, met?) for the table; None where no goal is set (docs/benchmarks.md).
GOALS: dict[str, tuple[str, Callable[[Any], bool]] | None] = {
    "s1_ratio": (">= 0.95", lambda v: v >= 0.95),
    "s1_ratio_tiny": (">= 0.9", lambda v: v >= 0.9),
    "s1_ratio_clip_pooled": (">= 0.95", lambda v: v >= 0.95),
    "s1_ratio_qwen25vl": (">= 0.95", lambda v: v >= 0.95),
    **{f"s1_tail_c16.{model}": ("<= 1.5", lambda v: v <= 1.5) for model in S1_MODELS},
    **{f"{key}.raw": ("<= 3", lambda v: v <= 3) for key in OVERHEAD_KEYS},
    **{f"{key}.json": ("<= 5", lambda v: v <= 5) for key in OVERHEAD_KEYS},
    "upload_hit_overhead_ms": ("<= 3", lambda v: v <= 3),
    "s2_ratio_safetensors": (">= 0.8", lambda v: v >= 0.8),
    "s3_speedup": (">= 3", lambda v: v >= 3),
    "s5_upload_bytes_ratio": ("<= 0.2", lambda v: v <= 0.2),
    "hashfirst_allmiss_ratio": (">= 0.97", lambda v: v >= 0.97),
    "rss_peak_mb.s1_vitb32": ("< 1024", lambda v: v < 1024),
}


def flat(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in KEYS:
        if key not in result:  # an earlier result, from before the key existed
            continue
        value = result[key]
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    for sub2, v2 in v.items():
                        out[f"{key}.{sub}.{sub2}"] = float(v2)
                else:
                    out[f"{key}.{sub}"] = float(v)
        else:
            out[key] = float(value)
    return out


def table(result: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    now = flat(result)
    then = flat(before) if before else {}
    lines = [
        f"| figure | {'before | ' if before else ''}value | goal | met |",
        f"|---|{'---|' if before else ''}---|---|---|",
    ]
    for name, value in now.items():
        goal = GOALS.get(name)
        met = ("yes" if goal[1](value) else "no") if goal else ""
        prev = f"{then[name]:.3g} | " if before and name in then else ("- | " if before else "")
        lines.append(f"| {name} | {prev}{value:.3g} | {goal[0] if goal else ''} | {met} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny counts and a shrunken ViT: checks the code runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--before", type=Path, default=RESULTS / "c68780e.json",
                        help="an earlier result to print side by side (ignored when missing)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    tune_allocator()  # the server's first step, before the bare pipeline's threads start
    result = run(QUICK if args.quick else Plan(), args.quick)
    missing = [k for k, v in flat(result).items() if not math.isfinite(v)]
    merge_into(args.out, result)  # the other benches' keys (vllm_peer, proxy, video) are kept
    before = json.loads(args.before.read_text()) if args.before.exists() and args.before != args.out else None
    m = result["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, load {m['load_avg_at_start']:.1f} at start, "
          f"torch {m['torch']} ({m['torch_threads']} threads), commit {m['commit']}, {result['seconds']:.0f} s")
    print(table(result, before))
    print(f"\nwrote {args.out}")
    if not args.no_plots:
        from bench.plots import plot

        for path in plot(result, before, args.out.parent):
            print(f"wrote {path}")
    if missing:
        print(f"not finite: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
