"""Redis is an accelerator, never a single point of failure: a Redis of our own, killed, restarted,
paused and filled, under a real server that must keep answering from its encoder throughout.

The server has no local tier (``--cache-mb 0``), so every hit it reports came from Redis.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.images import image_bytes
from tests.integration.test_redis_shared import b64, encode, h, metric, wait_for_redis_hit
from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration

TIMEOUT_MS = 100
INFLIGHT_AT_KILL = 200  # the 200 held requests (the /metrics scrape itself counts as one more)


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisProcess]:
    with start_redis() as server:
        yield server


@pytest.fixture(scope="module")
def server(own_redis: RedisProcess, server_logs: Path) -> Iterator[ServerProcess]:
    s = start_server(
        "--redis-url", own_redis.url, "--redis-timeout-ms", str(TIMEOUT_MS), "--cache-mb", "0",
        "--max-wait-ms", "5", log_dir=server_logs,
    )
    yield s
    assert s.stop() == 0, s.log()


def stored(server: ServerProcess, data: bytes) -> str:
    """Upload ``data`` and wait until it is a Redis hit; its mm_hash."""
    assert encode(server, [{"data": b64(data)}]).status_code == 200
    assert wait_for_redis_hit(server, h(data))["source"] == "redis"
    return h(data)


def wait_until(predicate: object, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


def test_redis_killed_under_200_requests_in_flight_then_restarted(
    server: ServerProcess, own_redis: RedisProcess
) -> None:
    known = stored(server, image_bytes("PNG", 64, 64, seed=500))
    host, port = server.url.removeprefix("http://").split(":")

    async def burst() -> tuple[list[tuple[int, float]], list[int], float]:
        # 200 requests are held in the server by their last byte, so they are in flight however
        # fast it encodes: racing senders against the server came to 1 in flight on a loaded CI
        # machine (2026-12-05), the server answering each as fast as the client sent it. A quarter
        # are let go just before the kill (they meet Redis dying), the rest after it.
        images = [image_bytes("PNG", 48 + i % 16, 48, seed=10_000 + i) for i in range(200)]
        bodies = [json.dumps({"items": [{"data": b64(data)}, {"hash": known}]}).encode() for data in images]

        async def open_one(body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(host, int(port))
            head = (
                f"POST /v1/encode HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body[:-1])
            await writer.drain()
            return reader, writer

        async def finish(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], body: bytes) -> tuple[int, float]:
            reader, writer = conn
            writer.write(body[-1:])
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 60)
            writer.close()
            return int(answer.split(b" ", 2)[1]), time.monotonic()

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def ready_probes() -> list[int]:
                codes = []
                for _ in range(20):
                    codes.append((await client.get("/ready")).status_code)
                    await asyncio.sleep(0.05)
                return codes

            async def inflight() -> float:
                text = (await client.get("/metrics")).text
                return float(re.search(r"^encode_server_inflight_requests\s+(\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

            conns = await asyncio.gather(*(open_one(b) for b in bodies))
            deadline = time.monotonic() + 30
            while (now := await inflight()) < INFLIGHT_AT_KILL:
                assert time.monotonic() < deadline, f"only {now} requests in flight, never {INFLIGHT_AT_KILL}"
                await asyncio.sleep(0.01)
            probes = asyncio.create_task(ready_probes())
            early = [asyncio.create_task(finish(c, b)) for c, b in zip(conns[:50], bodies[:50], strict=True)]
            await asyncio.sleep(0)
            own_redis.kill()  # SIGKILL by PID while the requests are in flight
            killed_at = time.monotonic()
            late = [asyncio.create_task(finish(c, b)) for c, b in zip(conns[50:], bodies[50:], strict=True)]
            return list(await asyncio.gather(*early, *late)), await probes, killed_at

    done, ready, killed_at = asyncio.run(burst())
    assert [code for code, _ in done] == [200] * 200
    assert sum(1 for _, at in done if at > killed_at) >= 50, "most requests should still be in flight at the kill"
    assert set(ready) == {200}
    wait_until(lambda: metric(server, "encode_server_redis_up") == 0.0, 10)
    assert metric(server, "encode_server_redis_errors_total") > 0
    assert httpx.get(server.url + "/ready").status_code == 200

    own_redis.start()  # the same port; the server is not restarted
    fresh = image_bytes("PNG", 80, 64, seed=501)

    def shared_hit() -> bool:
        encode(server, [{"data": b64(fresh)}])
        item = encode(server, [{"hash": h(fresh)}]).json()["items"][0]
        return bool(item["status"] == "hit" and item["source"] == "redis")

    assert wait_until(shared_hit, 15) < 15
    assert metric(server, "encode_server_redis_up") == 1.0


def test_redis_paused_longer_than_the_timeouts_requests_finish_in_bounded_time(
    server: ServerProcess, own_redis: RedisProcess
) -> None:
    known = stored(server, image_bytes("PNG", 64, 64, seed=600))
    own_redis.pause()  # SIGSTOP: connections hang rather than fail
    try:
        took = []
        for i in range(15):
            data = image_bytes("PNG", 56, 56, seed=20_000 + i)
            started = time.monotonic()
            r = encode(server, [{"data": b64(data)}, {"hash": known}])
            took.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
            assert [i["status"] for i in r.json()["items"]] == ["encoded", "miss"]
        # Each Redis call is bounded by 3 x the timeout; after 3 failures the breaker answers at once.
        # A hang would be the 60 s client timeout; 5 s leaves room for a slow machine.
        assert max(took) < 5.0, took
        assert httpx.get(server.url + "/ready").status_code == 200
        hand_off = encode(server, [{"data": b64(image_bytes("PNG", 50, 50, seed=601))}], **{"return": "metadata"})
        assert hand_off.status_code == 503 and hand_off.json()["error"]["type"] == "shared_tier_unavailable"
        assert "Retry-After" in hand_off.headers
        lookup = httpx.post(server.url + "/v1/lookup", json={"hashes": [known]}, timeout=5).json()["items"]
        assert lookup[0]["cached"] is False
    finally:
        own_redis.resume()
    assert wait_until(lambda: wait_for_redis_hit(server, known, timeout=0.1)["status"] == "hit", 15) < 15


def test_evicted_values_under_maxmemory_are_misses_then_re_encoded(
    server: ServerProcess, own_redis: RedisProcess
) -> None:
    client = own_redis.client()
    # The earlier tests' entries (the burst's 200, written back once Redis returned) would be the
    # least recently used and go first: only this test's values are to compete for the room.
    client.flushall()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(used + 1_500_000))  # room for ~10 values of 128 KiB
    try:
        images = [image_bytes("PNG", 448, 448, seed=700 + i) for i in range(24)]  # 256 x 128 float32 each
        written = metric(server, "encode_server_redis_writes_total", '{result="written"}')
        for i in range(0, len(images), 8):
            r = encode(server, [{"data": b64(d)} for d in images[i : i + 8]])
            assert r.status_code == 200
        wait_until(lambda: metric(server, "encode_server_redis_writes_total", '{result="written"}') >= written + 24, 10)
        assert int(client.info("stats")["evicted_keys"]) > 0
        statuses = [i["status"] for i in encode(server, [{"hash": h(d)} for d in images]).json()["items"]]
        assert "miss" in statuses and "hit" in statuses, statuses
        evicted = images[statuses.index("miss")]
        again = encode(server, [{"data": b64(evicted)}]).json()["items"][0]
        assert (again["status"], again["source"]) == ("encoded", "encoder")
        assert wait_for_redis_hit(server, h(evicted))["source"] == "redis"
    finally:
        client.config_set("maxmemory", "0")
        client.close()
