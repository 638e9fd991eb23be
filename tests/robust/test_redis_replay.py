"""Writes missed while Redis was unavailable are kept (bounded in bytes, counted) and replayed
once it answers again: an image first encoded during an outage still reaches every replica."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest
from encode_client.store import parse_value
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from encode_server.cache.redis import RedisTier
from encode_server.core.breaker import Backoff, CircuitBreaker
from encode_server.core.hashing import CacheKey
from encode_server.core.stored import ValueSpec
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.metrics import Metrics
from tests.calls import b64, encode, h, metric
from tests.images import image_bytes
from tests.redis_procs import free_cluster_port, start_redis
from tests.server import start_server

pytestmark = pytest.mark.integration

FP = "e" * 64


def _value(i: int, nbytes: int = 400) -> Embedding:
    return Embedding(EncodedTensor(bytes([i % 256]) * nbytes, (nbytes // 4, 1), "float32"), {"i": i})


def _count(metrics: Metrics, result: str) -> float:
    return metrics.redis_writes.labels(result=result)._value.get()


def test_replay_buffer_is_bounded_in_bytes_keeps_the_newest_and_replays_them() -> None:
    """A tier on a port where nothing answers yet; Redis starts there later."""
    port = free_cluster_port(set())

    async def scenario() -> None:
        metrics = Metrics()
        client = Redis(host="127.0.0.1", port=port, socket_timeout=0.1, socket_connect_timeout=0.1,
                       retry=Retry(NoBackoff(), 0))
        breaker = CircuitBreaker(3, Backoff(base=0.1, cap=0.2), probe_timeout=1.0)
        tier = RedisTier(client, ValueSpec(FP, "float32", 1), metrics, ttl=0, timeout=0.1,
                         max_value_bytes=1 << 20, write_queue=64, breaker=breaker, probe_interval=0.1,
                         replay_bytes=1000)
        await tier.start()
        cache_keys = [CacheKey(FP, f"{i:064x}", "replaytest") for i in range(12)]
        keys = [str(k) for k in cache_keys]
        for i, key in enumerate(cache_keys):
            tier.put_behind(key, _value(i))
            await asyncio.sleep(0.05)
            assert tier.replay_bytes <= 1000
        await asyncio.sleep(0.5)
        assert 0 < tier.replay_bytes <= 1000
        assert _count(metrics, "replay_dropped") >= 12 - 2  # 400-byte values: at most 2 fit
        assert metrics.redis_replay_bytes._value.get() == tier.replay_bytes
        with start_redis(port=port) as server:
            deadline = time.monotonic() + 10
            reader = server.client()
            while time.monotonic() < deadline and reader.exists(*keys) < 2:
                await asyncio.sleep(0.05)
            present = [k for k in keys if reader.exists(k)]
            # The newest two, oldest dropped first; each one parses as a valid value.
            assert present == keys[-2:]
            for k in present:
                assert parse_value(k, reader.get(k), fingerprint=FP).meta["i"] == keys.index(k)
            deadline = time.monotonic() + 10  # a wait of its own: the keys' above can take most of theirs under load
            while time.monotonic() < deadline and _count(metrics, "replayed") < 2:
                await asyncio.sleep(0.05)  # counted once the pipeline's answer is back
            assert _count(metrics, "replayed") == 2
            assert tier.replay_bytes == 0
            await tier.close()

    asyncio.run(scenario())


def test_an_image_encoded_while_redis_is_down_reaches_redis_when_it_is_back(tmp_path: Path) -> None:
    prefix = f"replay-{uuid.uuid4().hex[:8]}"
    with start_redis() as redis_proc:
        server = start_server(
            "--redis-url", redis_proc.url, "--redis-timeout-ms", "100", "--cache-prefix", prefix,
            "--max-wait-ms", "5", log_dir=tmp_path,
        )
        try:
            port = redis_proc.port
            redis_proc.kill()
            images = [image_bytes("PNG", 40 + i, 40, seed=7000 + i) for i in range(6)]
            for data in images:
                r = encode(server, [{"data": b64(data)}])
                assert r.status_code == 200 and r.json()["items"][0]["status"] == "encoded"
            assert metric(server, "encode_server_redis_writes_total", '{result="deferred"}') >= len(images)
            assert metric(server, "encode_server_redis_replay_bytes") > 0
            redis_proc.port = port
            redis_proc.start()
            fingerprint = httpx.get(server.url + "/v1/model").json()["fingerprint"]
            keys = [f"{prefix}:v1:{fingerprint}:{h(d)}" for d in images]
            client = redis_proc.client()
            deadline = time.monotonic() + 20
            while client.exists(*keys) < len(keys):
                assert time.monotonic() < deadline, f"{client.exists(*keys)} of {len(keys)} replayed"
                time.sleep(0.1)
            for key in keys:
                parse_value(key, client.get(key), fingerprint=fingerprint)
            while metric(server, "encode_server_redis_writes_total", '{result="replayed"}') < len(images):
                assert time.monotonic() < deadline, "replayed writes not counted"
                time.sleep(0.1)
            assert metric(server, "encode_server_redis_replay_bytes") == 0
            # A replica with no local tier now gets them from Redis instead of encoding again.
            replica = start_server("--redis-url", redis_proc.url, "--cache-prefix", prefix, "--cache-mb", "0",
                                   log_dir=tmp_path)
            try:
                items = encode(replica, [{"hash": h(d)} for d in images]).json()["items"]
                assert [(i["status"], i["source"]) for i in items] == [("hit", "redis")] * len(images)
            finally:
                assert replica.stop() == 0
        finally:
            assert server.stop() == 0, server.log()
