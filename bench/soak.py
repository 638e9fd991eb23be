"""Soak: long mixed load against one server with Redis, Redis paused once, resources watched.

    python -m bench.soak                  # 10 minutes (the figures in docs/robustness.md)
    python -m bench.soak --duration 60    # the short form that `make test` runs (tests/robust)

Load (HTTP and gRPC, ``--clients`` at once): uploads of a pool of images (hits once seen), new
images (misses: encoded), hash-only items, bad items (documented 400s), /v1/lookup and
/v1/tokens. The local cache is small (``--cache-mb``) so it evicts all the time. Redis (our own
``redis-server``) is paused (SIGSTOP) once, at 40% of the run, for ``--pause`` seconds.

Pass criteria (exit 1 otherwise), figures printed at the end:
- resident memory at the end within 10% of what it was after warm-up (the first 25% of the run);
- local cache bytes never above the budget;
- open file descriptors and threads flat (end within a small margin of after warm-up);
- zero 5xx, on either door.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from blake3 import blake3

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.images import image_bytes
from tests.redis_procs import start_redis
from tests.server import ServerProcess, start_server

__all__ = ["SoakResult", "main", "run_soak"]

WARMUP_SHARE = 0.25
RSS_GROWTH_LIMIT = 0.10
FD_MARGIN = 16
THREAD_MARGIN = 4


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _proc_status(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(field_name)


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int
    threads: int
    cache_bytes: float


@dataclass
class SoakResult:
    duration: float
    requests: int
    codes: Counter[str]
    latencies: list[float]
    samples: list[Sample]
    cache_budget: int
    pause_window: tuple[float, float]
    during_pause: Counter[str]
    replayed: float
    evictions: float
    failures: list[str] = field(default_factory=list)

    def report(self) -> str:
        warm = [s for s in self.samples if s.t >= WARMUP_SHARE * self.duration]
        first, last = warm[0], warm[-1]
        lat = sorted(self.latencies)
        q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000  # noqa: E731
        lines = [
            f"soak: {self.duration:.0f} s, {self.requests} requests ({self.requests / self.duration:.1f}/s), "
            f"p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms",
            "codes: " + ", ".join(f"{k}={v}" for k, v in sorted(self.codes.items())),
            f"Redis paused {self.pause_window[0]:.0f}-{self.pause_window[1]:.0f} s: during it "
            + ", ".join(f"{k}={v}" for k, v in sorted(self.during_pause.items()))
            + f"; writes replayed after it: {self.replayed:.0f}",
            f"RSS after warm-up {first.rss_kib / 1024:.0f} MiB, at the end {last.rss_kib / 1024:.0f} MiB "
            f"({(last.rss_kib - first.rss_kib) / first.rss_kib:+.1%}), peak "
            f"{max(s.rss_kib for s in self.samples) / 1024:.0f} MiB",
            f"local cache: max {max(s.cache_bytes for s in self.samples) / 2**20:.2f} MiB of a "
            f"{self.cache_budget / 2**20:.2f} MiB budget, {self.evictions:.0f} evictions",
            f"fds after warm-up {first.fds}, end {last.fds}, max {max(s.fds for s in warm)}; "
            f"threads {first.threads} -> {last.threads}, max {max(s.threads for s in warm)}",
            "PASS" if not self.failures else "FAIL: " + "; ".join(self.failures),
        ]
        return "\n".join(lines)


def _check(result: SoakResult) -> None:
    warm = [s for s in result.samples if s.t >= WARMUP_SHARE * result.duration]
    if len(warm) < 2:
        result.failures.append("too few samples after warm-up")
        return
    first, last = warm[0], warm[-1]
    growth = (last.rss_kib - first.rss_kib) / first.rss_kib
    if growth >= RSS_GROWTH_LIMIT:
        result.failures.append(f"RSS grew {growth:.1%} after warm-up")
    if max(s.cache_bytes for s in result.samples) > result.cache_budget:
        result.failures.append("local cache above its budget")
    if last.fds > first.fds + FD_MARGIN:
        result.failures.append(f"fds {first.fds} -> {last.fds}")
    if last.threads > first.threads + THREAD_MARGIN:
        result.failures.append(f"threads {first.threads} -> {last.threads}")
    fives = {k: v for k, v in result.codes.items() if k.startswith("5")}
    if fives:
        result.failures.append(f"5xx answers: {fives}")
    if result.requests == 0:
        result.failures.append("no requests")


async def _load(server: ServerProcess, duration: float, clients: int, pause_at: float, pause_s: float,
                redis_proc: Any, seed: int) -> tuple[int, Counter[str], list[float], list[Sample], Counter[str]]:
    rng = random.Random(seed)
    pool = [image_bytes("PNG", 32 + (i % 12) * 8, 32 + (i // 12) * 6, seed=200_000 + i) for i in range(120)]
    codes: Counter[str] = Counter()
    during_pause: Counter[str] = Counter()
    latencies: list[float] = []
    samples: list[Sample] = []
    started = time.monotonic()
    pid = server.proc.pid
    fresh = iter(range(10**9))
    paused = [False]

    def item(kind: str) -> tuple[str, Any]:
        if kind == "pool":
            return "data", rng.choice(pool)
        if kind == "new":
            n = next(fresh)
            return "data", image_bytes("PNG", 24 + n % 40, 24 + (n // 40) % 40, seed=300_000 + seed * 10**6 + n)
        if kind == "hash":
            return "hash", blake3(rng.choice(pool)).hexdigest()
        return "bad", b"definitely not an image"

    def pick() -> list[tuple[str, Any]]:
        kinds = rng.choices(["pool", "new", "hash", "bad"], weights=[55, 20, 20, 5], k=rng.randint(1, 4))
        if "bad" in kinds:
            kinds = ["bad"]  # one bad item fails its request: keep the others countable
        return [item(k) for k in kinds]

    async def http_one(client: httpx.AsyncClient) -> str:
        roll = rng.random()
        if roll < 0.05:
            r = await client.post("/v1/lookup", json={"hashes": [blake3(rng.choice(pool)).hexdigest()]})
        elif roll < 0.10:
            r = await client.post("/v1/tokens", json={"sizes": [[rng.randint(1, 2000), rng.randint(1, 2000)]]})
        else:
            body = []
            for kind, v in pick():
                body.append({"hash": v} if kind == "hash" else {"data": _b64(v)})
            r = await client.post("/v1/encode", json={"items": body})
        return str(r.status_code)

    async def grpc_one(stub: pb_grpc.EncoderStub) -> str:
        items = [pb.Item(hash=v) if kind == "hash" else pb.Item(data=v) for kind, v in pick()]
        try:
            await stub.Encode(pb.EncodeRequest(items=items), timeout=60)
        except grpc.aio.AioRpcError as exc:
            return "grpc:" + exc.code().name
        return "grpc:OK"

    async def client_loop(n: int, client: httpx.AsyncClient, stub: pb_grpc.EncoderStub) -> None:
        while time.monotonic() - started < duration:
            t0 = time.monotonic()
            try:
                code = await (grpc_one(stub) if n % 4 == 3 else http_one(client))
            except httpx.HTTPError as exc:
                code = f"transport:{type(exc).__name__}"
            latencies.append(time.monotonic() - t0)
            codes[code] += 1
            if paused[0]:
                during_pause[code] += 1

    async def sampler(client: httpx.AsyncClient) -> None:
        while time.monotonic() - started < duration:
            text = (await client.get("/metrics")).text
            samples.append(Sample(
                time.monotonic() - started, _proc_status(pid, "VmRSS"), _fds(pid), _proc_status(pid, "Threads"),
                _metric(text, "encode_server_cache_bytes", '{tier="local"}'),
            ))
            await asyncio.sleep(max(1.0, duration / 120))

    async def pauser() -> None:
        await asyncio.sleep(pause_at)
        redis_proc.pause()
        paused[0] = True
        await asyncio.sleep(pause_s)
        redis_proc.resume()
        paused[0] = False

    # Pooled connections expire before the server's --keep-alive-timeout (5 s), as a well-behaved
    # client's should: otherwise a reused connection can race the server closing it.
    limits = httpx.Limits(max_connections=clients + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client, \
            grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        await asyncio.gather(sampler(client), pauser(), *(client_loop(n, client, stub) for n in range(clients)))
    return sum(codes.values()), codes, latencies, samples, during_pause


def run_soak(duration: float = 600.0, *, clients: int = 16, pause: float = 20.0, cache_mb: float = 2.0,
             seed: int = 0, log_dir: Path | None = None) -> SoakResult:
    """Start Redis and a server, run the load, check; the servers end by PID either way."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="encode-soak-"))
    pause = min(pause, duration / 5)
    pause_at = 0.4 * duration
    with start_redis() as redis_proc:
        server = start_server(
            "--redis-url", redis_proc.url, "--redis-timeout-ms", "100", "--cache-mb", str(cache_mb),
            "--max-items", "8", "--max-wait-ms", "5", log_dir=log_dir,
        )
        try:
            requests, codes, latencies, samples, during = asyncio.run(
                _load(server, duration, clients, pause_at, pause, redis_proc, seed)
            )
            text = httpx.get(server.url + "/metrics").text
            result = SoakResult(
                duration, requests, codes, latencies, samples, int(cache_mb * 2**20), (pause_at, pause_at + pause),
                during, _metric(text, "encode_server_redis_writes_total", '{result="replayed"}'),
                _metric(text, "encode_server_cache_evictions_total", '{tier="local"}'),
            )
        finally:
            code = server.stop()
        if code != 0:
            result.failures.append(f"server exited {code}")
    _check(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pause", type=float, default=20.0, help="seconds Redis is paused, once")
    parser.add_argument("--cache-mb", type=float, default=2.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run_soak(args.duration, clients=args.clients, pause=args.pause, cache_mb=args.cache_mb)
    print(result.report())
    if args.json:
        args.json.write_text(json.dumps({
            "duration": result.duration, "requests": result.requests, "codes": dict(result.codes),
            "p50_ms": statistics.median(result.latencies) * 1000, "failures": result.failures,
            "samples": [s.__dict__ for s in result.samples],
        }, indent=1))
    return 0 if not result.failures else 1


if __name__ == "__main__":
    sys.exit(main())
