"""The service's races, in-process: a small encoder (builtin:tiny) and a shared tier built for the
test whose reads the test holds open, so that each interleaving is forced by events, not timing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from encode_server.config import Settings
from encode_server.core.errors import BadInput
from encode_server.core.hashing import CacheKey, mm_hash
from encode_server.core.types import Embedding, RequestItem, Return
from encode_server.encoders import load_encoder
from encode_server.metrics import Metrics
from encode_server.service import EncodeService
from tests.images import image_bytes
from tests.services import make_service


class HeldTier:
    """A shared tier that knows nothing, and holds its first ``held`` reads until ``release``."""

    name = "redis"

    def __init__(self, held: int = 1) -> None:
        self.held = held
        self.reading = asyncio.Event()  # set when a held read is waiting
        self.release = asyncio.Event()
        self.written: dict[CacheKey, Embedding] = {}

    async def get_many(self, keys: Sequence[CacheKey]) -> list[Embedding | None]:
        found = [self.written.get(k) for k in keys]  # what the store held when the read was sent
        if self.held > 0:
            self.held -= 1
            self.reading.set()
            await self.release.wait()
        return found

    async def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        return [k in self.written for k in keys]

    def put_behind(self, key: CacheKey, value: Embedding) -> None:
        self.written[key] = value

    async def put_now(self, entries: Sequence[tuple[CacheKey, Embedding]]) -> None:
        self.written.update(entries)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def encoder():  # type: ignore[no-untyped-def]
    return load_encoder("builtin:tiny", device="cpu")


async def _started(service: EncodeService) -> EncodeService:
    await service.start()
    return service


def test_an_encode_that_finishes_during_the_redis_read_is_a_local_hit(encoder) -> None:  # type: ignore[no-untyped-def]
    image = image_bytes("PNG", 32, 24, seed=3)

    async def scenario() -> None:
        tier = HeldTier(held=1)
        service = await _started(make_service(encoder, Settings(cache_mb=16, warmup="quick"), Metrics(), shared=tier))
        try:
            # A hash-only request misses locally and waits on the (held) Redis read...
            waiting = asyncio.create_task(service.encode([RequestItem(0, mm_hash=mm_hash(image))]))
            await asyncio.wait_for(tier.reading.wait(), 10)
            # ...while an upload of the same image is encoded and cached locally.
            [uploaded] = await service.encode([RequestItem(0, data=image)])
            assert (uploaded.status, uploaded.source) == ("encoded", "encoder")
            tier.release.set()  # Redis answers "miss" for the first request
            [result] = await asyncio.wait_for(waiting, 10)
            assert (result.status, result.source) == ("hit", "local")
            assert result.embedding == uploaded.embedding
            assert service.local.lru.pinned_bytes == 0
        finally:
            await service.close()

    asyncio.run(scenario())


def test_the_first_bad_item_is_named_whatever_the_order_encodes_fail(encoder) -> None:  # type: ignore[no-untyped-def]
    good = [image_bytes("PNG", 16 + i, 16, seed=20 + i) for i in range(3)]
    bad = [b"not an image at all", b"\x89PNG\r\n\x1a\n truncated"]

    async def scenario() -> None:
        service = await _started(make_service(encoder, Settings(cache_mb=16, warmup="quick"), Metrics()))
        try:
            items = [RequestItem(0, data=good[0]), RequestItem(1, data=good[1]), RequestItem(2, data=bad[1]),
                     RequestItem(3, data=good[2]), RequestItem(4, data=bad[0])]
            with pytest.raises(BadInput) as first:
                await service.encode(items)
            assert (first.value.index, first.value.type) == (2, "invalid_image")
            # One failing encode shared by two requests (single-flight) is named at each one's index.
            a = service.encode([RequestItem(0, data=good[0]), RequestItem(1, data=bad[0])])
            b = service.encode([RequestItem(0, data=bad[0])])
            outcomes = await asyncio.gather(a, b, return_exceptions=True)
            assert [(type(o), getattr(o, "index", None)) for o in outcomes] == [(BadInput, 1), (BadInput, 0)]
            # Nothing was left behind: the good items of the failed requests are cached, no pins.
            assert service.local.lru.pinned_bytes == 0 and not service._inflight
            results = await service.encode([RequestItem(i, data=d) for i, d in enumerate(good)])
            assert [r.status for r in results] == ["hit"] * 3
        finally:
            await service.close()

    asyncio.run(scenario())


def test_metadata_return_hands_every_resolved_item_to_the_shared_tier(encoder) -> None:  # type: ignore[no-untyped-def]
    images = [image_bytes("PNG", 20, 20 + i, seed=40 + i) for i in range(2)]

    async def scenario() -> None:
        tier = HeldTier(held=0)
        service = await _started(make_service(encoder, Settings(cache_mb=16, warmup="quick"), Metrics(), shared=tier))
        try:
            await service.encode([RequestItem(0, data=images[0])])  # local now; maybe not in Redis yet
            tier.written.clear()
            items = [RequestItem(0, data=images[0]), RequestItem(1, data=images[1]), RequestItem(2, data=images[1])]
            results = await service.encode(items, return_kind=Return.METADATA)
            assert [r.key for r in results] == [service.key_for(mm_hash(d)) for d in (images[0], images[1], images[1])]
            assert set(tier.written) == {r.key for r in results}
        finally:
            await service.close()

    asyncio.run(scenario())
