"""Each item goes to its own kind's home (``encode_server/kinds``) once, and to no other kind's: the
service looks the kind up by the item's modality and never reads an item's bytes itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from encode_server.config import Settings
from encode_server.core.errors import BadInput
from encode_server.core.types import AUDIO, IMAGE, VIDEO, RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import Encoder
from encode_server.kinds import ImageKind, VideoKind
from encode_server.metrics import Metrics
from encode_server.service import EncodeService
from tests.audios import make_audio
from tests.images import image_bytes
from tests.services import make_service
from tests.videos import make_video

SETTINGS = Settings(cache_mb=16, max_wait_ms=0, warmup="quick")


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return load_encoder("builtin:tiny", device="cpu")


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, int]]]:
    """Every (kind, step, index) a kind's ``prepare`` or ``count`` was entered with, in order."""
    calls: list[tuple[str, str, int]] = []
    for kind in (ImageKind, VideoKind):
        for step in ("prepare", "count"):
            inner = getattr(kind, step)

            def recording(self: Any, data: bytes, index: int, settings: Any, *, _inner: Any = inner,
                          _step: str = step) -> Any:
                calls.append((self.modality, _step, index))
                return _inner(self, data, index, settings)

            monkeypatch.setattr(kind, step, recording)
    yield calls


def _run(encoder: Encoder, scenario: Any) -> None:
    async def main() -> None:
        service = make_service(encoder, SETTINGS, Metrics())
        await service.start()
        try:
            await scenario(service)
        finally:
            await service.close()

    asyncio.run(main())


def test_an_encode_enters_each_items_kind_once_and_no_other(encoder: Encoder, entered: list[Any]) -> None:
    image, video = image_bytes("PNG", 40, 32, seed=1), make_video(8, 4.0, 32, 32)

    async def scenario(service: EncodeService) -> None:
        assert set(service.kinds) == {IMAGE, VIDEO}  # the built-in family's modalities, from app.py
        entered.clear()  # the warm-up's image
        items = [RequestItem(0, data=image), RequestItem(1, data=video, modality=VIDEO)]
        assert [r.status for r in await service.encode(items)] == ["encoded", "encoded"]
        assert sorted(entered) == [(IMAGE, "prepare", 0), (VIDEO, "prepare", 1)]
        entered.clear()
        assert [r.status for r in await service.encode(items)] == ["hit", "hit"]  # a hit is never decoded
        assert entered == []

    _run(encoder, scenario)


def test_a_token_count_enters_each_items_kind_once_and_never_prepares(encoder: Encoder, entered: list[Any]) -> None:
    image, video = image_bytes("JPEG", 64, 48, seed=2), make_video(8, 4.0, 32, 32)

    async def scenario(service: EncodeService) -> None:
        entered.clear()
        counts = await service.tokens(items=[RequestItem(0, data=video, modality=VIDEO), RequestItem(1, data=image)])
        assert [c.num_tokens > 0 for c in counts] == [True, True]
        assert entered == [(VIDEO, "count", 0), (IMAGE, "count", 1)]

    _run(encoder, scenario)


def test_a_modality_the_family_does_not_take_enters_no_kind(encoder: Encoder, entered: list[Any]) -> None:
    async def scenario(service: EncodeService) -> None:
        entered.clear()
        items = [RequestItem(0, data=image_bytes("PNG", 8, 8, seed=3)), RequestItem(1, data=make_audio(1.0),
                                                                                 modality=AUDIO)]
        with pytest.raises(BadInput) as refused:
            await service.encode(items)
        assert (refused.value.type, refused.value.index) == ("unsupported_modality", 1)
        assert "takes images and videos only, not audio" in str(refused.value)
        assert entered == []  # refused whole, before any item is decoded

    _run(encoder, scenario)
