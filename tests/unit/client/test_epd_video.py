"""The EPD rewrite of video parts, without I/O: which parts are videos, what a family must declare
to take one, and the pixel-free part vLLM gets (the hand-off's answers given as values)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import Result, mm_hash
from encode_client.epd import EpdContract, EPDError, apply_results, check_chat_request, check_contract
from encode_client.keys import tenant_digest

from encode_server.core.hashing import cache_key

MP4 = b"\x00\x00\x00\x18ftypmp42 not decoded here"
PNG = b"\x89PNG\r\n\x1a\n not decoded here"
VIDEO_URL = "data:video/mp4;base64," + base64.b64encode(MP4).decode()
IMAGE_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
FP = "cd" * 32
QWEN3 = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw", "timestamps")})
VIDEO_META = {"video_grid_thw": [2, 4, 4], "timestamps": [0.25, 1.25], "frames": 4}  # one key no field names
IMAGE_META = {"image_grid_thw": [1, 4, 4]}


def body(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4}


def video(url: Any = VIDEO_URL, **extra: Any) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def result(data: bytes, meta: dict[str, Any], tenant: str | None = None, modality: str = "video") -> Result:
    """What encode-server's hand-off answers for ``data`` (its store key included)."""
    h = mm_hash(data)
    key = cache_key(FP, h, prefix="encode", tenant=tenant, modality=modality)
    return Result(0, h, "encoded", None, 8, (), None, meta=meta, key=key)


def test_video_parts_are_planned_beside_images_in_request_order() -> None:
    plan = check_chat_request(body(
        {"type": "text", "text": "t"}, video(), {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        {"type": "video_url", "video_url": VIDEO_URL},  # the string form, as for images
    ))
    assert [(p.where, p.modality, p.data) for p in plan.videos] == [
        ("messages[0].content[1]", "video", MP4), ("messages[0].content[3]", "video", MP4)]
    assert [(p.where, p.modality) for p in plan.images] == [("messages[0].content[2]", "image")]
    assert [p.where for p in plan.media] == ["messages[0].content[2]", "messages[0].content[1]",
                                            "messages[0].content[3]"]


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (video("http://example.com/v.mp4"), "only data: URLs"),
        (video("file:///etc/passwd"), "only data: URLs"),
        (video("data:video/mp4,plain"), "data:video/mp4;base64"),
        (video("data:video/mp4;base64,@@@"), "not valid base64"),
        (video(None), "video_url.url must be a string"),
        ({"type": "video_url"}, "video_url.url must be a string"),
        ({**video(), "uuid": "ab" * 32}, "a client's uuid is refused"),
        ({**video(), "uuid": None}, "a client's uuid is refused"),
        ({"video_url": {"url": VIDEO_URL}}, "string 'type'"),
        ({"type": "video_embeds", "video_embeds": VIDEO_META, "uuid": "ab" * 32}, "video_embeds parts from clients"),
        ({"type": "video_embeds", "video_embeds": VIDEO_META}, "video_embeds parts from clients"),
    ],
)
def test_a_video_part_the_rewrite_cannot_take_is_refused_naming_it(part: dict[str, Any], words: str) -> None:
    with pytest.raises(EPDError, match=words) as info:
        check_chat_request(body({"type": "text", "text": "t"}, part))
    assert info.value.where == "messages[0].content[1]"


@pytest.mark.parametrize(
    ("contract", "words"),
    [
        (EpdContract("pixel_free", {"image": ("image_grid_thw",)}), "declares no pixel-free video item"),
        (EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ()}), "declares no pixel-free video"),
        (EpdContract("pixels_uuid", {}), "pixels \\+ uuid"),
        (EpdContract("pixels_uuid", {"video": ("video_grid_thw",)}), "pixels \\+ uuid"),
    ],
)
def test_a_video_for_a_family_without_a_pixel_free_video_item_is_refused(contract: EpdContract, words: str) -> None:
    plan = check_chat_request(body({"type": "image_url", "image_url": {"url": IMAGE_URL}}, video()))
    with pytest.raises(EPDError, match=words) as info:
        check_contract(plan, contract)
    assert info.value.where == "messages[0].content[1]"
    check_contract(check_chat_request(body({"type": "image_url", "image_url": {"url": IMAGE_URL}})), contract)


def test_a_video_becomes_video_embeds_with_exactly_the_declared_fields_and_its_identifier() -> None:
    request = body({"type": "image_url", "image_url": {"url": IMAGE_URL, "detail": "high"}},
                   video(detail="x", fps=30), {"type": "text", "text": "what happens?"})
    plan = check_chat_request(request)
    check_contract(plan, QWEN3)
    out = apply_results(request, plan, [result(PNG, IMAGE_META, modality="image"), result(MP4, VIDEO_META)], QWEN3)
    assert out["messages"][0]["content"] == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": mm_hash(PNG)},
        {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4], "timestamps": [0.25, 1.25]},
         "uuid": f"video:{mm_hash(MP4)}"},
        {"type": "text", "text": "what happens?"},
    ]
    assert request["messages"][0]["content"][1] == video(detail="x", fps=30), "the caller's body is not changed"
    assert VIDEO_URL not in repr(out) and IMAGE_URL not in repr(out)


def test_a_tenants_video_is_named_by_its_tenants_key() -> None:
    plan = check_chat_request(body(video()))
    out = apply_results(body(video()), plan, [result(MP4, VIDEO_META, tenant="acme")], QWEN3)
    assert out["messages"][0]["content"][0]["uuid"] == f"t:{tenant_digest('acme')}:video:{mm_hash(MP4)}"


def test_an_answer_that_does_not_fit_the_video_is_refused_naming_the_part() -> None:
    plan = check_chat_request(body({"type": "text", "text": "t"}, video()))
    lacking = result(MP4, {"video_grid_thw": [2, 4, 4]})
    with pytest.raises(EPDError, match="lacks \\['timestamps'\\]") as info:
        apply_results(body(video()), plan, [lacking], QWEN3)
    assert info.value.where == "messages[0].content[1]"
    other = result(PNG, VIDEO_META)  # the key of another file
    with pytest.raises(EPDError, match="does not name this video"):
        apply_results(body(video()), plan, [other], QWEN3)
    as_image = result(MP4, VIDEO_META, modality="image")  # this file's key, but as an image's
    with pytest.raises(EPDError, match=r"does not name this video.*not of a video"):
        apply_results(body(video()), plan, [as_image], QWEN3)
    with pytest.raises(EPDError, match="holds no embedding for video"):
        apply_results(body(video()), plan, [Result(0, mm_hash(MP4), "miss", None, None, (), None)], QWEN3)


def test_a_video_hand_off_says_video_on_every_item_and_an_image_one_does_not() -> None:
    from encode_client import _http
    from encode_client._images import WireItem, media

    h = mm_hash(MP4)
    video = media(MP4, "video")
    assert video.modality == "video" and video.content_type == "video/mp4"
    sent = _http.build("http://e", "handoff", [WireItem(h, None, video.modality), WireItem(h, MP4, video.modality)],
                       response="json", api_key=None)
    assert sent.json == {"items": [{"hash": h, "modality": "video"},
                                   {"hash": h, "data": base64.b64encode(MP4).decode(), "modality": "video"}],
                         "return": "metadata"}
    # an image_url part is an image, whatever its bytes look like: no modality on the wire
    forced = media(MP4, "image")
    assert forced.modality == "image"
    image = _http.build("http://e", "handoff", [WireItem(h, None, forced.modality)], response="json", api_key=None)
    assert image.json == {"items": [{"hash": h}], "return": "metadata"}
    with pytest.raises(ValueError, match="modality must be"):
        media(MP4, "text")


QWEN25 = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw",)},
                     {"video": {"second_per_grid_ts": "float32"}})


def test_a_tensor_field_goes_as_a_tensor_string_built_from_the_meta_only_when_the_meta_has_it() -> None:
    """Qwen2.5-VL's ``second_per_grid_ts``: a tensor string (vLLM's chat parser refuses it as JSON);
    Qwen2-VL's meta has none, so its part has the grid alone."""
    import io

    import numpy as np

    plan = check_chat_request(body(video(second_per_grid_ts=9.0)))
    meta = {"video_grid_thw": [2, 4, 4], "second_per_grid_ts": 1.25, "frames": 5}
    part = apply_results(body(video()), plan, [result(MP4, meta)], QWEN25)["messages"][0]["content"][0]
    assert set(part) == {"type", "video_embeds", "uuid"} and part["uuid"] == f"video:{mm_hash(MP4)}"
    assert set(part["video_embeds"]) == {"video_grid_thw", "second_per_grid_ts"}
    assert part["video_embeds"]["video_grid_thw"] == [2, 4, 4]
    loaded = np.load(io.BytesIO(base64.b64decode(part["video_embeds"]["second_per_grid_ts"])))
    assert loaded.dtype == np.float32 and loaded.shape == () and float(loaded) == 1.25
    qwen2 = apply_results(body(video()), plan, [result(MP4, {"video_grid_thw": [2, 4, 4]})], QWEN25)
    assert qwen2["messages"][0]["content"][0]["video_embeds"] == {"video_grid_thw": [2, 4, 4]}
    bad = result(MP4, {"video_grid_thw": [2, 4, 4], "second_per_grid_ts": "AAAA"})
    with pytest.raises(EPDError, match=r"second_per_grid_ts for video .*finite numbers only") as info:
        apply_results(body(video()), plan, [bad], QWEN25)
    assert info.value.where == "messages[0].content[0]"
