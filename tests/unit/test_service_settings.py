"""Per-request processor settings through the service: off unless the operator turns them on, an
entry of their own (never another setting's embedding), today's key under the defaults, and
``/v1/tokens``' count equal to the rows an encode gives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from encode_server.config import Settings
from encode_server.core.errors import BadInput, TooLarge
from encode_server.core.types import VIDEO, RequestItem
from encode_server.encoders import load_encoder
from encode_server.encoders.base import Encoder
from encode_server.metrics import Metrics
from encode_server.service import EncodeService
from tests.images import image_bytes
from tests.services import make_service
from tests.videos import make_video

ON = Settings(cache_mb=16, warmup="quick", trust_request_mm_kwargs=True, max_image_pixels=1_000_000)
IMAGE = image_bytes("PNG", 280, 280, seed=7)
FEWER = {"max_pixels": 12544}


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return load_encoder("builtin:tiny", device="cpu")


def _run(encoder: Encoder, settings: Settings, body: Callable[[EncodeService], Awaitable[Any]]) -> Any:
    async def scenario() -> Any:
        service = make_service(encoder, settings, Metrics())
        await service.start()
        try:
            return await body(service)
        finally:
            await service.close()

    return asyncio.run(scenario())


def test_settings_are_refused_naming_the_flag_unless_the_operator_turns_them_on(encoder: Encoder) -> None:
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
    encoder: Encoder,
) -> None:
    async def body(service: EncodeService) -> None:
        plain, restated, fewer = [
            (await service.encode([RequestItem(0, data=IMAGE, settings=s)]))[0]
            for s in (None, {k: service.item_settings.defaults[k] for k in ("min_pixels", "max_pixels")}, FEWER)
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
    encoder: Encoder, settings: dict[str, Any], words: str
) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match=words) as refused:
            await service.encode([RequestItem(0, data=IMAGE), RequestItem(1, data=IMAGE, settings=settings)])
        assert (refused.value.type, refused.value.index) == ("invalid_setting", 1)

    _run(encoder, ON, body)


def test_a_video_takes_no_pixel_setting(encoder: Encoder) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match="does not apply to a video") as refused:
            await service.encode([RequestItem(0, mm_hash="ab" * 32, modality=VIDEO, settings=FEWER)])
        assert refused.value.index == 0
        with pytest.raises(BadInput, match="fps does not apply to an image") as refused:
            await service.encode([RequestItem(0, data=IMAGE, settings={"fps": 1.0})])

    _run(encoder, ON, body)


# 21 frames at 6 fps (3.5 s): 6 frames sampled at the default 2 fps (3 groups), 4 at 1 fps (the
# loader's minimum; 2 groups), 14 at 4 fps (7 groups); 56x56 frames: 4 rows a group.
CLIP = make_video(21, 6.0, 56, 56, seed=33)


def _video(settings: dict[str, Any] | None = None, index: int = 0) -> RequestItem:
    return RequestItem(index, data=CLIP, modality=VIDEO, settings=settings)


def test_a_videos_fps_samples_its_frames_keys_its_entry_and_tokens_count_its_rows(encoder: Encoder) -> None:
    async def body(service: EncodeService) -> None:
        assert service.item_settings.defaults["fps"] == ON.video_fps
        results = {fps: (await service.encode([_video(None if fps is None else {"fps": fps})]))[0]
                   for fps in (None, 1.0, 4.0)}
        restated = (await service.encode([_video({"fps": ON.video_fps})]))[0]
        again = (await service.encode([_video({"fps": 4})]))[0]  # an int is the same rate
        rows = {fps: r.embedding.num_tokens for fps, r in results.items() if r.embedding is not None}
        assert rows == {None: 12, 1.0: 8, 4.0: 28}
        keys = {fps: r.key for fps, r in results.items()}
        assert len(set(keys.values())) == 3
        assert keys[None] is not None and keys[None].identifier == f"video:{results[None].mm_hash}"  # today's
        assert (restated.key, restated.status) == (keys[None], "hit")
        assert (again.key, again.status) == (keys[4.0], "hit")
        for fps, result in results.items():
            [count] = await service.tokens(items=[_video(None if fps is None else {"fps": fps})])
            assert result.embedding is not None
            assert (count.num_tokens, count.meta) == (result.embedding.num_tokens, result.embedding.meta), fps
        [found] = await service.lookup([results[1.0].mm_hash], modality=VIDEO, settings={"fps": 1.0})
        assert found.cached

    _run(encoder, ON, body)


@pytest.mark.parametrize(
    ("settings", "words"),
    [({"fps": 0}, "fps must be above 0 and at most 30, got 0"), ({"fps": -1.0}, "above 0"),
     ({"fps": 31}, "fps must be above 0 and at most 30, got 31"), ({"fps": "2"}, "fps must be a number, got str"),
     ({"fps": True}, "fps must be a number, got bool"),
     ({"num_frames": 8}, "num_frames is not a setting of this model's family")],
)
def test_a_bad_video_setting_is_bad_input_naming_the_key_and_the_item(
    encoder: Encoder, settings: dict[str, Any], words: str
) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match=words) as refused:
            await service.encode([_video(), _video(settings, index=1)])
        assert (refused.value.type, refused.value.index) == ("invalid_setting", 1)
        with pytest.raises(BadInput, match=words):
            await service.tokens(items=[_video(settings)])

    _run(encoder, ON, body)


def test_a_videos_fps_is_refused_naming_the_flag_when_settings_are_off(encoder: Encoder) -> None:
    async def body(service: EncodeService) -> None:
        with pytest.raises(BadInput, match="--trust-request-mm-kwargs") as refused:
            await service.tokens(items=[_video({"fps": 1.0})])
        assert refused.value.type == "settings_disabled"

    _run(encoder, Settings(cache_mb=16, warmup="quick"), body)


def test_an_fps_sampling_more_frames_than_the_video_limit_is_refused_naming_the_item(encoder: Encoder) -> None:
    async def body(service: EncodeService) -> None:
        assert len(await service.tokens(items=[_video({"fps": 2.0})])) == 1
        with pytest.raises(TooLarge, match="samples 14 frames, above the limit of 8") as refused:
            await service.tokens(items=[_video({"fps": 4.0})])
        assert (refused.value.type, refused.value.index) == ("video_too_large", 0)

    _run(encoder, replace(ON, max_video_frames=8), body)
