"""``--max-queue`` counted once, in items (``admission.QueueBound``): a long video split into more
parts than the queue holds is one item, admitted whole or refused whole before any part is queued,
and a full queue refuses it without touching the requests it holds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence

import pytest

from encode_server.config import Settings
from encode_server.core.errors import EncodeServerError, Unavailable
from encode_server.core.types import VIDEO, EncodedTensor, RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import Encoder, PreparedItem
from encode_server.metrics import Metrics
from encode_server.service import EncodeService
from tests.images import image_bytes
from tests.services import make_service
from tests.videos import make_video

# 16 frames at 4 fps, sampled at 2 fps: 8 frames, 4 temporal groups of 16 cost tokens (64 in all);
# with --max-batch-tokens 16 the built-in model encodes it as 4 parts, twice --max-queue.
VIDEO_ROWS, PARTS, MAX_QUEUE = 16, 4, 2
SETTINGS = Settings(cache_mb=16, max_queue=MAX_QUEUE, max_batch_tokens=16, max_batch_size=1, max_wait_ms=0,
                    warmup="quick")


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return load_encoder("builtin:tiny", device="cpu")


@pytest.fixture(scope="module")
def video() -> bytes:
    return make_video(16, 4.0, 64, 64)


@pytest.fixture
def gate(encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Forward passes wait for the gate (set: they run): what is admitted stays pending meanwhile."""
    opened = threading.Event()
    inner = encoder.forward

    def forward(batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        assert opened.wait(30)
        return inner(batch)

    monkeypatch.setattr(encoder, "forward", forward)
    yield opened
    opened.set()


async def _settled(service: EncodeService) -> None:
    """Until nothing is pending: no item admitted, no part queued or in a forward pass."""
    for _ in range(200):
        if service.queue.pending == 0 and service.batcher.pending == 0 and service.batcher.passes_running == 0:
            return
        await asyncio.sleep(0.01)


def test_a_video_split_into_more_parts_than_the_queue_holds_is_one_item(encoder: Encoder, video: bytes) -> None:
    # The bug: the service counted the video once, the batcher each part, so the third part was
    # refused (503) with the first two queued for nobody.
    async def scenario() -> None:
        service = make_service(encoder, SETTINGS, Metrics())
        await service.start()
        try:
            assert len(service.kinds[VIDEO].split(*_prepared(service, video))) == PARTS > MAX_QUEUE
            image = image_bytes("PNG", 24, 24, seed=5)
            [encoded], [other] = await asyncio.gather(
                service.encode([RequestItem(0, data=video, modality=VIDEO)]),
                service.encode([RequestItem(0, data=image)]),
            )
            assert encoded.status == "encoded" and encoded.embedding is not None
            assert encoded.embedding.tensor.shape[0] == VIDEO_ROWS
            assert other.status == "encoded"
            await _settled(service)
            assert (service.queue.pending, service.batcher.pending) == (0, 0)
        finally:
            await service.close()

    asyncio.run(scenario())


def test_a_full_queue_refuses_a_video_before_any_part_is_queued(
    encoder: Encoder, video: bytes, gate: threading.Event
) -> None:
    async def scenario() -> None:
        metrics = Metrics()
        service = make_service(encoder, SETTINGS, metrics)
        gate.set()  # the warm-up's pass
        await service.start()
        gate.clear()
        try:
            images = [image_bytes("PNG", 24, 24 + i, seed=60 + i) for i in range(MAX_QUEUE)]
            holding = [asyncio.create_task(service.encode([RequestItem(0, data=d)])) for d in images]
            for _ in range(500):  # both admitted, their passes held at the gate
                if service.queue.pending == MAX_QUEUE:
                    break
                await asyncio.sleep(0.01)
            queued = service.batcher.pending
            with pytest.raises(Unavailable) as refused:
                await service.encode([RequestItem(0, data=video, modality=VIDEO)])
            assert (refused.value.type, refused.value.retry_after) == ("overloaded", 1.0)
            # Refused whole, before anything was decoded or queued: the requests held are untouched.
            assert (service.queue.pending, service.batcher.pending) == (MAX_QUEUE, queued)
            gate.set()
            assert [r.status for [r] in await asyncio.gather(*holding)] == ["encoded"] * MAX_QUEUE
            [retried] = await service.encode([RequestItem(0, data=video, modality=VIDEO)])
            assert retried.status == "encoded"
            await _settled(service)
            assert (service.queue.pending, service.batcher.pending) == (0, 0)
        finally:
            gate.set()
            await service.close()

    asyncio.run(scenario())


def _prepared(service: EncodeService, video: bytes) -> tuple[PreparedItem, int]:
    return service.kinds[VIDEO].prepare(video, 0, None), SETTINGS.max_batch_tokens
