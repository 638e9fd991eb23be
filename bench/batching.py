"""Cross-request batching and the cache, measured side by side in one run on this machine.

Starts real servers (the built-in model, CPU) on loopback and sends the same workload to each:
- throughput of C concurrent single-image requests, with batching (--max-batch-size 32) and
  without (--max-batch-size 1), and the ratio;
- latency of a fresh encode against a local-tier hit for the same image, and the ratio.

Figures, not assertions: the machines are shared and noisy. Run: ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from blake3 import blake3

from tests.images import image_bytes
from tests.server import ServerProcess, start_server


def _forward_stats(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("encode_server_batch_size_count"), value("encode_server_batch_size_sum")


async def _burst(server: ServerProcess, images: list[bytes]) -> float:
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(client.post("/v1/encode", json={"items": [{"data": base64.b64encode(d).decode()}]}) for d in images)
        )
        elapsed = time.perf_counter() - started
    assert all(r.status_code == 200 for r in responses)
    return elapsed


def _latency(server: ServerProcess, n: int, seed: int) -> tuple[list[float], list[float]]:
    encode, hit = [], []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(n):
            data = image_bytes("PNG", 224, 224, seed=seed + i)
            t = time.perf_counter()
            client.post("/v1/encode", json={"items": [{"data": base64.b64encode(data).decode()}]}).raise_for_status()
            encode.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.post("/v1/encode", json={"items": [{"hash": blake3(data).hexdigest()}]}).raise_for_status()
            hit.append(time.perf_counter() - t)
    return encode, hit


def _ms(xs: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else 1000 * xs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="encode-bench-"))
    configs = {"batched": ["--max-batch-size", "32", "--max-wait-ms", "5"], "unbatched": ["--max-batch-size", "1"]}
    results: dict[str, dict[str, float]] = {}
    for name, extra in configs.items():
        server = start_server(*extra, log_dir=logs)
        try:
            times = []
            calls_before, images_before = _forward_stats(server)
            for r in range(args.rounds):
                images = [
                    image_bytes("PNG", args.size, args.size, seed=10_000 * (r + 1) + i) for i in range(args.concurrency)
                ]
                times.append(asyncio.run(_burst(server, images)))
            calls, imgs = (a - b for a, b in zip(_forward_stats(server), (calls_before, images_before), strict=True))
            encode, hit = _latency(server, 20, seed=99_000)
            results[name] = {
                "images_per_s": args.concurrency / statistics.median(times),
                "forward_calls_per_burst": calls / args.rounds,
                "mean_batch": imgs / calls,
                "encode_p50_ms": _ms(encode, 50),
                "hit_p50_ms": _ms(hit, 50),
                "hit_p99_ms": _ms(hit, 99),
            }
        finally:
            server.stop()
    b, u = results["batched"], results["unbatched"]
    print(f"workload: {args.rounds} bursts of {args.concurrency} concurrent single-image requests, "
          f"{args.size}x{args.size} PNG, built-in model on CPU")
    for name, r in results.items():
        print(f"{name:>10}: {r['images_per_s']:7.1f} images/s  {r['forward_calls_per_burst']:5.1f} forward calls "
              f"per burst  mean batch {r['mean_batch']:5.1f}  encode p50 {r['encode_p50_ms']:6.1f} ms  "
              f"hit p50 {r['hit_p50_ms']:5.2f} ms  p99 {r['hit_p99_ms']:5.2f} ms")
    print(f"batching speed-up (batched / unbatched throughput): {b['images_per_s'] / u['images_per_s']:.2f}x")
    print(f"local hit vs fresh encode (p50 latency ratio):      {b['encode_p50_ms'] / b['hit_p50_ms']:.1f}x")


if __name__ == "__main__":
    main()
