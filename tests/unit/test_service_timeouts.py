"""A requester that gives up (the HTTP timeout cancels it) leaks no pin, queue slot or in-flight entry."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from encode_server.config import Settings
from encode_server.core.hashing import mm_hash
from encode_server.core.types import RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import EncodedTensor, Encoder, PreparedItem
from encode_server.metrics import Metrics
from tests.images import image_bytes
from tests.services import make_service


class GatedEncoder(Encoder):
    """The built-in model, with a forward pass that waits while ``gate`` is clear."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner
        self.info = inner.info
        self.gate = threading.Event()
        self.gate.set()

    def preprocess(self, image: Any) -> PreparedItem:
        return self.inner.preprocess(image)

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor]:
        assert self.gate.wait(20)
        return self.inner.forward(batch)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        return self.inner.count_tokens(width, height)


def test_cancelled_requests_leave_no_pins_slots_or_inflight_entries() -> None:
    async def scenario() -> None:
        encoder = GatedEncoder(load_encoder("builtin:tiny", device="cpu"))
        service = make_service(encoder, Settings(cache_mb=16), Metrics())
        await service.start()
        try:
            known = image_bytes("PNG", 24, 24, seed=1)
            await service.encode([RequestItem(0, data=known)])  # cached: the next request pins it
            fresh = [image_bytes("PNG", 24, 24, seed=10 + i) for i in range(3)]
            encoder.gate.clear()  # every request below is cancelled while its items wait on the model
            for tenant in (None, "acme"):
                items = [RequestItem(0, data=known), *(RequestItem(i + 1, data=d) for i, d in enumerate(fresh))]
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(service.encode(items, tenant=tenant), 0.05)
            assert service.local.lru.pinned_bytes == 0  # the hit's pin was released on cancel
            encoder.gate.set()
            for _ in range(200):  # the abandoned encodes finish behind the requesters (<= 10 s)
                if service.batcher.pending == 0 and not service._inflight:
                    break
                await asyncio.sleep(0.05)
            assert service.batcher.pending == 0 and not service._inflight and service.queue.pending == 0
            assert service.local.lru.pinned_bytes == 0
            # The abandoned encodes went on and were cached, each under its tenant's key.
            for tenant in (None, "acme"):
                found = await service.lookup([mm_hash(d) for d in fresh], tenant=tenant)
                assert [f.cached for f in found] == [True] * len(fresh)
            service.local.lru.check_invariants()
        finally:
            await service.close()

    asyncio.run(scenario())
