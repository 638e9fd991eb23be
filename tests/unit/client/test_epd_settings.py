"""A chat's ``mm_processor_kwargs`` through the EPD rewrite, without I/O: refused unless trusted
(naming the flag), checked against the family's published keys before anything is handed off,
every item handed off under them, and kept for vLLM only where its processor sees the pixels."""

from __future__ import annotations

from typing import Any

import pytest
from encode_client._http import build
from encode_client.epd import EpdContract, EPDError, check_chat_request

from tests.unit.client.test_epd_flow import (
    MP4_A,
    MP4_B,
    PNG_A,
    PNG_B,
    _run_async,
    _run_sync,
    _Script,
    chat,
    image,
    video,
)

KEYS = {"min_pixels": {"type": "int", "minimum": 1, "maximum": 1000, "modalities": ["image"]},
        "max_pixels": {"type": "int", "minimum": 1, "maximum": 1000, "modalities": ["image"]}}
PIXEL_FREE = EpdContract("pixel_free", {"image": ("image_grid_thw",)}, settings_enabled=True, settings=KEYS)
# A Qwen video family's keys as GET /v1/model publishes them: the rate is vLLM's loader's
RATE = {"fps": {"type": "float", "minimum": None, "maximum": 30, "exclusive_minimum": 0, "modalities": ["video"],
                "vllm_field": "media_io_kwargs.video"}}
VIDEOS = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw", "timestamps")},
                     settings_enabled=True, settings={**KEYS, **RATE})
PIXELS_UUID = EpdContract("pixels_uuid", {}, settings_enabled=True, settings=KEYS)
FEWER = {"max_pixels": 500}


def test_settings_are_refused_naming_the_proxys_flag_unless_it_trusts_them() -> None:
    with pytest.raises(EPDError, match="--trust-request-mm-kwargs") as refused:
        check_chat_request(chat(image(PNG_A)) | {"mm_processor_kwargs": FEWER})
    assert refused.value.where == "mm_processor_kwargs"
    plan = check_chat_request(chat(image(PNG_A)) | {"mm_processor_kwargs": FEWER}, trust_request_mm_kwargs=True)
    assert plan.settings == FEWER
    with pytest.raises(EPDError, match="must be an object"):
        check_chat_request(chat(image(PNG_A)) | {"mm_processor_kwargs": [1]}, trust_request_mm_kwargs=True)
    with pytest.raises(EPDError, match="--trust-request-mm-kwargs") as media:
        check_chat_request(chat(video(MP4_A)) | {"media_io_kwargs": {"video": {"fps": 1}}})
    assert media.value.where == "media_io_kwargs"
    plan = check_chat_request(chat(video(MP4_A)) | {"media_io_kwargs": {"video": {"fps": 1}}},
                              trust_request_mm_kwargs=True)
    assert plan.video_settings == {"fps": 1}
    for given, where in (({"image": {"image_mode": "RGBA"}}, "media_io_kwargs.image"),
                         ({"video": [1]}, "media_io_kwargs.video"), ([1], "media_io_kwargs")):
        with pytest.raises(EPDError) as refused:
            check_chat_request(chat(video(MP4_A)) | {"media_io_kwargs": given}, trust_request_mm_kwargs=True)
        assert refused.value.where == where


@pytest.mark.parametrize(
    ("settings", "where", "words"),
    [({"max_pixel": 5}, "mm_processor_kwargs.max_pixel", "not a setting"),
     ({"max_pixels": "5"}, "mm_processor_kwargs.max_pixels", "of type int"),
     ({"max_pixels": True}, "mm_processor_kwargs.max_pixels", "of type int"),
     ({"max_pixels": 1001}, "mm_processor_kwargs.max_pixels", "within"),
     ({"min_pixels": 0}, "mm_processor_kwargs.min_pixels", "within")],
)
def test_settings_the_family_would_refuse_are_refused_before_anything_is_handed_off(
    settings: dict[str, Any], where: str, words: str
) -> None:
    script = _Script()
    with pytest.raises(EPDError, match=words) as refused:
        _run_sync(chat(image(PNG_A)) | {"mm_processor_kwargs": settings}, script, contract=PIXEL_FREE,
                  trust_request_mm_kwargs=True)
    assert refused.value.where == where
    assert script.calls == []  # nothing moved


def test_a_server_that_takes_no_settings_refuses_them_before_anything_is_handed_off() -> None:
    script = _Script()
    off = EpdContract("pixel_free", {"image": ("image_grid_thw",)}, settings=KEYS)
    with pytest.raises(EPDError, match="encode-server takes no per-request"):
        _run_sync(chat(image(PNG_A)) | {"mm_processor_kwargs": FEWER}, script, contract=off,
                  trust_request_mm_kwargs=True)
    assert script.calls == []


@pytest.mark.parametrize("run", [_run_sync, _run_async], ids=["sync", "async"])
def test_every_item_is_handed_off_under_the_settings_and_vllm_gets_the_grid_not_the_kwargs(run: Any) -> None:
    script = _Script()
    body = chat(image(PNG_A), image(PNG_B)) | {"mm_processor_kwargs": FEWER}
    rewritten, results = run(body, script, contract=PIXEL_FREE, trust_request_mm_kwargs=True)
    assert len(results) == 2
    handoffs = [call for call in script.calls if call.op == "handoff"]
    assert handoffs and all(item.settings == FEWER for call in handoffs for item in call.payload)
    assert "mm_processor_kwargs" not in rewritten
    wire = build("http://e", "handoff", handoffs[0].payload, response="json", api_key=None)
    assert all(item["mm_processor_kwargs"] == FEWER for item in wire.json["items"])


@pytest.mark.parametrize("run", [_run_sync, _run_async], ids=["sync", "async"])
def test_a_pixels_uuid_familys_images_keep_the_kwargs_and_their_identifiers_go_to_the_connector(run: Any) -> None:
    """vLLM's processor sizes such an image from its pixels under the kwargs, so they stay; vLLM 0.32
    hashes every uuid with them, so the identifiers (the settings' entries) are listed in
    ``ec_transfer_params`` in order, for the connector to read those entries."""
    script = _Script()
    body = chat(image(PNG_A), image(PNG_B)) | {"mm_processor_kwargs": FEWER}
    rewritten, _ = run(body, script, contract=PIXELS_UUID, trust_request_mm_kwargs=True)
    handoffs = [call for call in script.calls if call.op == "handoff"]
    assert handoffs and all(item.settings == FEWER for call in handoffs for item in call.payload)
    assert rewritten["mm_processor_kwargs"] == FEWER
    uuids = [part["uuid"] for part in rewritten["messages"][0]["content"] if "uuid" in part]
    assert len(uuids) == 2  # the server's keys' (a real one's: p:{digest}:..., tests/vllm/test_proxy_settings.py)
    assert rewritten["ec_transfer_params"] == {"encode_server": {"items": {"image": uuids}}}
    assert [p["image_url"]["url"] for p in rewritten["messages"][0]["content"][:2]] == [
        p["image_url"]["url"] for p in body["messages"][0]["content"][:2]]


def test_the_clients_wire_carries_settings_as_json_and_leaves_todays_bodies_alone() -> None:
    from encode_client._images import WireItem

    item = WireItem("ab" * 32, b"\x89PNG", settings=FEWER)
    with_settings = build("http://e", "encode", [item], response="json", api_key=None)
    assert with_settings.content is None and with_settings.json["items"][0]["mm_processor_kwargs"] == FEWER
    plain = build("http://e", "encode", [item._replace(settings=None)], response="json", api_key=None)
    assert plain.content == b"\x89PNG" and plain.json is None  # a raw upload, as always
    lookup = build("http://e", "lookup", ("image", ["ab" * 32], FEWER), response="json", api_key=None)
    assert lookup.json == {"hashes": ["ab" * 32], "mm_processor_kwargs": FEWER}
    assert build("http://e", "lookup", ("image", ["ab" * 32], None), response="json", api_key=None).json == {
        "hashes": ["ab" * 32]}
    sizes = build("http://e", "tokens", ("sizes", [(9, 9)], FEWER), response="json", api_key=None)
    assert sizes.json == {"sizes": [[9, 9]], "mm_processor_kwargs": FEWER}


def test_the_fetcher_never_asks_for_a_settings_identifier_by_its_hash_alone() -> None:
    """A hash-only request names no settings: asked, the server would answer the defaults' entry
    for an item preprocessed otherwise. So it is not asked (no request goes out), and is None."""
    from encode_client.fetch import EncoderFetcher

    h = "ab" * 32
    fetcher = EncoderFetcher(["http://127.0.0.1:9"], fingerprint="cd" * 32, timeout=0.5)
    try:
        assert fetcher.fetch_many([f"p:{'5e' * 32}:{h}"]) == {f"p:{'5e' * 32}:{h}": None}
        assert fetcher.counts["settings"] == 1 and fetcher.counts["requests"] == 0
    finally:
        fetcher.close()


@pytest.mark.parametrize("run", [_run_sync, _run_async], ids=["sync", "async"])
def test_each_video_is_handed_off_under_media_io_kwargs_and_vllm_gets_neither_field(run: Any) -> None:
    script = _Script()
    body = chat(image(PNG_A), video(MP4_A), video(MP4_B)) | {"media_io_kwargs": {"video": {"fps": 1.5}}}
    rewritten, results = run(body, script, contract=VIDEOS, trust_request_mm_kwargs=True)
    assert len(results) == 3
    handoffs = [item for call in script.calls if call.op == "handoff" for item in call.payload]
    assert [(item.modality, item.settings) for item in handoffs] == [  # an image is loaded as ever
        ("image", None), ("video", {"fps": 1.5}), ("video", {"fps": 1.5})]
    assert "media_io_kwargs" not in rewritten and "mm_processor_kwargs" not in rewritten
    wire = build("http://e", "handoff", [handoffs[1]], response="json", api_key=None)
    assert wire.json["items"][0]["mm_processor_kwargs"] == {"fps": 1.5}  # the server's item settings, by name


@pytest.mark.parametrize(
    ("body", "where", "words"),
    [({"media_io_kwargs": {"video": {"fps": 0}}}, "media_io_kwargs.video.fps", "within \\(0, 30\\]"),
     ({"media_io_kwargs": {"video": {"fps": 31}}}, "media_io_kwargs.video.fps", "within"),
     ({"media_io_kwargs": {"video": {"fps": "1"}}}, "media_io_kwargs.video.fps", "of type float"),
     ({"media_io_kwargs": {"video": {"num_frames": 8}}}, "media_io_kwargs.video.num_frames", "not a setting"),
     ({"media_io_kwargs": {"video": {"max_pixels": 8}}}, "media_io_kwargs.video.max_pixels", "in mm_processor_kwargs"),
     ({"mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs.fps", "in media_io_kwargs.video, not here"),
     ({"mm_processor_kwargs": FEWER}, "mm_processor_kwargs.max_pixels", "does not apply to a video")],
)
def test_video_settings_the_family_would_refuse_are_refused_naming_the_key_before_anything_moves(
    body: dict[str, Any], where: str, words: str
) -> None:
    script = _Script()
    with pytest.raises(EPDError, match=words) as refused:
        _run_sync(chat(video(MP4_A)) | body, script, contract=VIDEOS, trust_request_mm_kwargs=True)
    assert refused.value.where == where
    assert [call.op for call in script.calls if call.op == "handoff"] == []
