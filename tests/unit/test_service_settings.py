"""Per-request processor settings through the service: off unless the operator turns them on, an
entry of their own (never another setting's embedding), today's key under the defaults, and
``/v1/tokens``' count equal to the rows an encode gives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from encode_server.config import Settings
from encode_server.core.errors import BadInput
from encode_server.core.types import VIDEO, RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import VisionEncoder
from encode_server.metrics import Metrics
from encode_server.service import EncodeService
from tests.images import image_bytes
from tests.services import make_service

ON = Settings(cache_mb=16, warmup="quick", trust_request_mm_kwargs=True, max_image_pixels=1_000_000)
IMAGE = image_bytes("PNG", 280, 280, seed=7)
FEWER = {"max_pixels": 12544}


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return load_encoder("builtin:tiny", device="cpu")


def _run(encoder: VisionEncoder, settings: Settings, body: Callable[[EncodeService], Awaitable[Any]]) -> Any:
    async def scenario() -> Any:
        service = make_service(encoder, settings, Metrics())
        await service.start()
        try:
            return await body(service)
        finally:
            await service.close()

    return asyncio.run(scenario())


def test_settings_are_refused_naming_the_flag_unless_the_operator_turns_them_on(encoder: VisionEncoder) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match="--trust-request-mm-kwargs") as refused:
            await service.encode([RequestItem(0, data=IMAGE), RequestItem(1, data=IMAGE, settings=FEWER)])
        assert (refused.value.type, refused.value.index) == ("settings_disabled", 1)
        with pytest.raises(BadInput, match="--trust-request-mm-kwargs"):
            await service.tokens(sizes=[[280, 280]], settings=FEWER)
        with pytest.raises(BadInput, match="--trust-request-mm-kwargs"):
            await service.lookup(["ab" * 32], settings=FEWER)

    _run(encoder, Settings(cache_mb=16, warmup="quick"), body)


def test_one_image_under_two_settings_is_two_entries_and_the_defaults_restated_are_todays(
    encoder: VisionEncoder,
) -> None:
    async def body(service: EncodeService) -> None:
        plain, restated, fewer = [
            (await service.encode([RequestItem(0, data=IMAGE, settings=s)]))[0]
            for s in (None, service.setting_defaults, FEWER)
        ]
        assert plain.key is not None and restated.key is not None and fewer.key is not None
        assert restated.key == plain.key and restated.status == "hit"
        assert plain.key.identifier == plain.mm_hash  # today's identifier
        assert fewer.key != plain.key and fewer.status == "encoded"
        assert fewer.key.identifier.startswith("p:") and fewer.key.identifier.endswith(plain.mm_hash)
        assert plain.embedding is not None and fewer.embedding is not None
        assert fewer.embedding.num_tokens < plain.embedding.num_tokens
        # Written another way (key order), the same setting hits the same entry.
        again = (await service.encode([RequestItem(0, data=IMAGE, settings={"min_pixels": 56 * 56, **FEWER})]))[0]
        assert (again.key, again.status) == (fewer.key, "hit")
        # A hash alone finds each entry under its own settings only.
        [found] = await service.lookup([plain.mm_hash], settings=FEWER)
        assert found.cached
        [count] = await service.tokens(sizes=[[280, 280]], settings=FEWER)
        assert (count.num_tokens, count.meta) == (fewer.embedding.num_tokens, fewer.embedding.meta)
        [upload] = await service.tokens(items=[RequestItem(0, data=IMAGE, settings=FEWER)])
        assert upload.num_tokens == fewer.embedding.num_tokens

    _run(encoder, ON, body)


@pytest.mark.parametrize(
    ("settings", "words"),
    [({"max_pixel": 1}, "not a setting"), ({"max_pixels": "9"}, "an integer"),
     ({"max_pixels": 200705}, "at most 200704 \\(the checkpoint's max_pixels\\)"),
     ({"min_pixels": 200705}, "at most 200704 \\(the checkpoint's max_pixels\\)")],
)
def test_a_bad_setting_is_bad_input_naming_the_key_and_the_item(
    encoder: VisionEncoder, settings: dict[str, Any], words: str
) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match=words) as refused:
            await service.encode([RequestItem(0, data=IMAGE), RequestItem(1, data=IMAGE, settings=settings)])
        assert (refused.value.type, refused.value.index) == ("invalid_setting", 1)

    _run(encoder, ON, body)


def test_a_video_takes_no_pixel_setting_yet(encoder: VisionEncoder) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match="does not apply to a video") as refused:
            await service.encode([RequestItem(0, mm_hash="ab" * 32, modality=VIDEO, settings=FEWER)])
        assert refused.value.index == 0

    _run(encoder, ON, body)
