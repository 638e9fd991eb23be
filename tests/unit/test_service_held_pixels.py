"""Pixels an image holds while it waits for its batch stay charged to the request-memory budget
(batched preprocessing: a PNG decoded by Pillow waits as pinned pixels), and go back after."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from encode_server.app import build_service
from encode_server.config import Settings
from encode_server.core.budget import ByteBudget
from encode_server.core.errors import BadInput, EncodeServerError
from encode_server.core.types import EncodedTensor, RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import Encoder, PreparedItem
from encode_server.imaging import read_header
from encode_server.kinds import image_inputs
from encode_server.metrics import Metrics
from tests.images import image_bytes

HELD = 3 * 64 * 48  # what a 64x48 image's RGB pixels weigh


@dataclass
class _Waiting:
    pixels: bytearray


class HoldingEncoder(Encoder):
    """The built-in model, prepared as a batched encoder prepares: ``prepare`` keeps the image's
    pixels in ``pending`` (``held_bytes``), ``forward`` runs behind a gate and fails the items whose
    bytes end in b"BAD" alone, as a batch that finds a stream bad when it decodes it."""

    def __init__(self) -> None:
        self.inner = load_encoder("builtin:tiny", device="cpu")
        self.info = self.inner.info
        self.gate = threading.Event()
        self.entered = threading.Event()

    def preprocess(self, image: Any) -> PreparedItem:
        return self.inner.preprocess(image)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        return self.inner.count_tokens(width, height)

    def defer(self, data: bytes, *, max_pixels: int, index: int | None = None) -> PreparedItem | None:
        header = read_header(data, max_pixels=max_pixels, index=index)
        prepared = image_inputs(self.inner, data, max_pixels=max_pixels, index=index)
        prepared.pending = _Waiting(bytearray(3 * header.width * header.height))
        prepared.held_bytes = len(prepared.pending.pixels)
        prepared.meta = {**prepared.meta, "bad": data.endswith(b"BAD")}
        return prepared

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        self.entered.set()
        assert self.gate.wait(20)
        good = [item for item in batch if not item.meta["bad"]]
        encoded = iter(self.inner.forward(good))
        return [BadInput("cannot decode", type="invalid_image") if item.meta["bad"] else next(encoded)
                for item in batch]


async def _all_given_back(budget: ByteBudget) -> bool:
    """The batch's last references go when the forward thread lets go of them: within moments."""
    for _ in range(200):
        if budget.used == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_held_pixels_are_charged_until_the_batch_is_done_and_a_bad_item_fails_alone() -> None:
    async def scenario() -> None:
        encoder = HoldingEncoder()
        budget = ByteBudget(64 * 2**20)
        forward = ThreadPoolExecutor(1)
        service = build_service(encoder, Settings(cache_mb=0), Metrics(), forward, budget=budget)
        encoder.gate.set()
        await service.start()  # the warm-up's image: charged, then given back
        assert await _all_given_back(budget)
        encoder.gate.clear()
        encoder.entered.clear()
        good = image_bytes("PNG", 64, 48, seed=1)
        bad = image_bytes("PNG", 64, 48, seed=2) + b"BAD"
        task = asyncio.gather(service.encode([RequestItem(0, data=good)]), service.encode([RequestItem(0, data=bad)]),
                              return_exceptions=True)
        assert await asyncio.to_thread(encoder.entered.wait, 10)
        assert budget.used >= 2 * HELD  # both images' pixels, while their batch runs
        encoder.gate.set()
        ok, failed = await task
        assert isinstance(failed, BadInput) and failed.type == "invalid_image"
        assert not isinstance(ok, BaseException) and ok[0].status == "encoded"
        assert await _all_given_back(budget)  # not held by the idle batcher either
        await service.close()
        forward.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
