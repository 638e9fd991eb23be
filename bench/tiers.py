"""Hit latency from each tier against a fresh encode, side by side in one run, and request latency
while Redis is paused (SIGSTOP).

Starts its own ``redis-server`` on a free loopback port and two real servers (built-in model, CPU):
L has a local tier (and Redis), R has none (``--cache-mb 0``), so every R hit is a Redis hit.

- HTTP, 1 MiB of embeddings per request: the built-in model gives at most 256 x 128 float32
  (128 KiB) per image, so each request carries 8 distinct 448x448 images = 1 MiB, answered as
  ``application/vnd.safetensors``. Fresh encode (upload to L), local hit (hash-only to L), Redis hit
  (hash-only to R, after the write-behind landed).
- Tier only, one 1 MiB embedding (2048 x 128 float32): ``LocalTier.get_and_pin`` against
  ``RedisTier.get_many`` (the read, the safetensors parse and the validation), no HTTP.
- Redis paused: requests to R (one upload + one hash-only item) while Redis is stopped, with
  ``--redis-timeout-ms`` at its default.

Figures, not assertions. Run: ``make bench`` or ``python -m bench.tiers``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from blake3 import blake3

from encode_server.cache.local import LocalTier
from encode_server.cache.redis import create_redis_tier
from encode_server.config import Settings
from encode_server.core.hashing import CacheKey
from encode_server.core.stored import ValueSpec
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.metrics import Metrics
from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess

SAFETENSORS = {"Accept": "application/vnd.safetensors"}


def pct(xs: list[float], q: int) -> float:
    """q-th percentile in ms (nearest rank)."""
    s = sorted(xs)
    return 1000 * s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def timed_post(client: httpx.Client, url: str, items: list[dict]) -> float:
    started = time.perf_counter()
    r = client.post(url + "/v1/encode", json={"items": items}, headers=SAFETENSORS)
    took = time.perf_counter() - started
    r.raise_for_status()
    return took


def wait_written(redis_client: object, keys: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while redis_client.exists(*keys) != len(keys):  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("write-behind did not land")
        time.sleep(0.005)


def http_tiers(local: ServerProcess, remote: ServerProcess, redis: RedisProcess, prefix: str, rounds: int) -> dict:
    fp = httpx.get(local.url + "/v1/model").json()["fingerprint"]
    rc = redis.client()
    out: dict[str, list[float]] = {"encode": [], "local": [], "redis": []}
    with httpx.Client(timeout=120) as client:
        for r in range(rounds + 1):
            images = [image_bytes("PNG", 448, 448, seed=1_000 * r + i) for i in range(8)]
            hashes = [{"hash": blake3(d).hexdigest()} for d in images]
            enc = timed_post(client, local.url, [{"data": base64.b64encode(d).decode()} for d in images])
            loc = timed_post(client, local.url, hashes)
            wait_written(rc, [f"{prefix}:v1:{fp}:{x['hash']}" for x in hashes])
            red = timed_post(client, remote.url, hashes)
            if r:  # round 0 warms connections up
                out["encode"].append(enc)
                out["local"].append(loc)
                out["redis"].append(red)
    return out


async def tier_only(redis: RedisProcess, n: int) -> dict[str, list[float]]:
    metrics = Metrics()
    fp, mm = "f" * 64, "e" * 64
    key = CacheKey(fp, mm, prefix=f"bench-{uuid.uuid4().hex[:8]}")
    rng = np.random.default_rng(0)
    value = Embedding(EncodedTensor(rng.standard_normal((2048, 128), dtype=np.float32).tobytes(), (2048, 128),
                                    "float32"), {"image_grid_thw": [1, 64, 128]})
    local = LocalTier(64 << 20, metrics)
    local.put(key, value)
    tier = create_redis_tier(Settings(redis_url=redis.url), metrics, ValueSpec(fp, "float32", 128))
    await tier.start()
    try:
        await tier.put_now([(key, value)])
        out: dict[str, list[float]] = {"local": [], "redis": []}
        for _ in range(n):
            t = time.perf_counter()
            assert local.get_and_pin(key) is not None
            local.unpin(key)
            out["local"].append(time.perf_counter() - t)
            t = time.perf_counter()
            assert (await tier.get_many([key]))[0] == value
            out["redis"].append(time.perf_counter() - t)
        return out
    finally:
        await tier.close()


def paused(remote: ServerProcess, redis: RedisProcess, n: int) -> list[float]:
    known = image_bytes("PNG", 448, 448, seed=0)  # stored in round 0
    took = []
    with httpx.Client(timeout=60) as client:
        redis.pause()
        try:
            for i in range(n):
                data = image_bytes("PNG", 224, 224, seed=90_000 + i)
                items = [{"data": base64.b64encode(data).decode()}, {"hash": blake3(known).hexdigest()}]
                took.append(timed_post(client, remote.url, items))
        finally:
            redis.resume()
    return took


def line(name: str, xs: list[float]) -> str:
    return f"  {name:<28} p50 {pct(xs, 50):9.3f} ms   p99 {pct(xs, 99):9.3f} ms   (n={len(xs)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="encode-bench-"))
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    with start_redis() as redis:
        common = ["--redis-url", redis.url, "--cache-prefix", prefix, "--max-items", "64"]
        local, remote = start_servers(common, [*common, "--cache-mb", "0"], log_dir=logs)
        try:
            http = http_tiers(local, remote, redis, prefix, args.rounds)
            tier = asyncio.run(tier_only(redis, 200))
            stalled = paused(remote, redis, 30)
        finally:
            local.stop()
            remote.stop()
    print("HTTP, 8 x 448x448 images per request = 1 MiB of float32 embeddings, safetensors response,")
    print("built-in model on CPU, Redis on loopback:")
    print(line("fresh encode (upload)", http["encode"]))
    print(line("local-tier hit (hash-only)", http["local"]))
    print(line("Redis hit (hash-only)", http["redis"]))
    e, lo, r = (statistics.median(http[k]) for k in ("encode", "local", "redis"))
    print(f"  ratios (p50): encode / local {e / lo:.1f}x   encode / redis {e / r:.1f}x   redis / local {r / lo:.1f}x")
    print("Tier only, one 1 MiB embedding (2048 x 128 float32), no HTTP:")
    print(line("LocalTier.get_and_pin", tier["local"]))
    print(line("RedisTier.get_many (+parse)", tier["redis"]))
    print(f"  ratio (p50): redis / local {statistics.median(tier['redis']) / statistics.median(tier['local']):.0f}x")
    print("Redis paused (SIGSTOP), requests to R: 1 upload (224x224) + 1 hash-only item, default timeouts:")
    print(line("request while paused", stalled) + f"   max {1000 * max(stalled):.1f} ms")


if __name__ == "__main__":
    main()
