"""A hand-off writes through; the write-behind queued for the same encode is then skipped, not
sent to Redis a second time. A write queued after the hand-off still goes out."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from encode_server.cache.redis import RedisTier
from encode_server.core.hashing import CacheKey
from encode_server.core.stored import ValueSpec
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.metrics import Metrics

FP = "d" * 64


def _value(i: int) -> Embedding:
    return Embedding(EncodedTensor(bytes([i]) * 4096, (1024, 1), "float32"), {"i": i})


def _count(metrics: Metrics, result: str) -> float:
    return metrics.redis_writes.labels(result=result)._value.get()


async def _drained(tier: RedisTier, metrics: Metrics, done: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _count(metrics, "written") + _count(metrics, "superseded") < done:
        assert time.monotonic() < deadline, "the write-behind queue was not drained"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("handed_off_twice", [False, True])
def test_a_handed_off_value_is_not_written_again_behind_the_response(handed_off_twice: bool) -> None:
    prefix = f"handofftest-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        metrics = Metrics()
        client = Redis(host="127.0.0.1", port=6379)
        tier = RedisTier(client, ValueSpec(FP, "float32", 1), metrics, ttl=60, timeout=2.0,
                         max_value_bytes=1 << 20, write_queue=64)
        fresh, other = CacheKey(FP, "a" * 64, prefix), CacheKey(FP, "b" * 64, prefix)
        reader = Redis(host="127.0.0.1", port=6379)
        try:
            # As the service does for an image this request encoded: queued behind, then the
            # hand-off writes it before answering. The writer has not run yet (not started).
            tier.put_behind(fresh, _value(1))
            tier.put_behind(other, _value(2))
            if handed_off_twice:
                tier.put_behind(fresh, _value(1))  # a second encode of it was queued too
            await tier.put_now([(fresh, _value(1))])
            assert await reader.exists(str(fresh)) == 1
            await tier.start()
            queued_fresh = 2 if handed_off_twice else 1
            await _drained(tier, metrics, 1 + 1 + queued_fresh)
            assert _count(metrics, "superseded") == queued_fresh
            assert _count(metrics, "written") == 2  # the hand-off's, and the other key's write-behind
            assert await reader.exists(str(other)) == 1
            # Queued after the hand-off: written as usual.
            tier.put_behind(fresh, _value(1))
            await _drained(tier, metrics, 2 + 1 + queued_fresh)
            assert _count(metrics, "written") == 3 and _count(metrics, "superseded") == queued_fresh
        finally:
            await tier.close()
            keys = [k async for k in reader.scan_iter(match=f"{prefix}:*")]
            if keys:
                await reader.delete(*keys)
            await reader.aclose()

    asyncio.run(scenario())
