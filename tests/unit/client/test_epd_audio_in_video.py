"""``use_audio_in_video`` through the EPD rewrite (the Omni thinkers: each video's own sound, its
rows interleaved with the video's by vLLM): the contract both Omni families publish for it, and a
chat rewritten for it: every item as its file + uuid, each video handed off twice (as a video and,
the same bytes, as an audio item), the key kept for vLLM and the identifiers listed in
``ec_transfer_params`` in vLLM's item order, since vLLM hashes every uuid with the key. Taken only
with ``--trust-request-mm-kwargs``, as vLLM takes it (pure).
Against vLLM: tests/vllm/test_qwen2_5_omni.py and test_proxy_families.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import Result, mm_hash
from encode_client.epd import (
    EpdContract,
    EPDError,
    apply_results,
    check_chat_request,
    check_contract,
)
from encode_client.keys import EC_PARAMS_KEY, own_identifier

from encode_server.core.hashing import cache_key
from encode_server.encoders import FAMILIES
from encode_server.encoders.qwen2_5_omni import FAMILY as QWEN2_5_OMNI
from encode_server.encoders.qwen3_omni import FAMILY as QWEN3_OMNI

FP = "cd" * 32
PNG, MP4, WEBM, WAV = b"\x89PNG not decoded", b"\x00\x00\x00\x18ftypmp4 one", b"\x1aE\xdf\xa3 webm two", b"RIFF wav"
KWARGS = {"use_audio_in_video": True}


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _video(data: bytes) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": _url("video/mp4", data)}}


IMAGE = {"type": "image_url", "image_url": {"url": _url("image/png", PNG)}}
AUDIO = {"type": "audio_url", "audio_url": {"url": _url("audio/wav", WAV)}}


def _chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "t"}]}], **extra}


def _contract(family: Any = QWEN2_5_OMNI) -> EpdContract:
    return EpdContract.from_model({"id": "omni", "family": family.describe()})


def _answer(data: bytes, modality: str) -> Result:
    h = mm_hash(data)
    meta = {"image": {"image_grid_thw": [1, 6, 10]}, "video": {"video_grid_thw": [2, 24, 24]},
            "audio": {"audio_feature_lengths": [233]}}[modality]
    return Result(0, h, "encoded", None, 4, (), None, meta=meta, key=cache_key(FP, h, prefix="e", modality=modality))


def _rewrite(body: dict[str, Any], family: Any = QWEN2_5_OMNI) -> tuple[dict[str, Any], list[Any]]:
    plan = check_chat_request(body, trust_request_mm_kwargs=True)
    contract = _contract(family)
    check_contract(plan, contract)
    handed = [(part.data, part.modality) for part in plan.media]
    return apply_results(body, plan, [_answer(*each) for each in handed], contract), handed


def test_both_omni_thinkers_publish_it_and_no_other_family_does() -> None:
    for family in FAMILIES:
        published = family.describe()["epd"] or {}
        assert published.get("audio_in_video", False) is (family in (QWEN2_5_OMNI, QWEN3_OMNI)), family.name
        if family.epd is not None:
            assert _contract(family).audio_in_video is (family in (QWEN2_5_OMNI, QWEN3_OMNI)), family.name


@pytest.mark.parametrize("family", [QWEN2_5_OMNI, QWEN3_OMNI], ids=["qwen2_5_omni", "qwen3_omni"])
def test_a_video_with_its_sound_goes_as_its_file_with_both_items_named(family: Any) -> None:
    """The video stays a ``video_url`` with its
    identifier (vLLM's chat parser takes the sound only from the file), its bytes are handed off as a
    video and as an audio item, the key goes on to vLLM alone, and both identifiers are listed."""
    out, handed = _rewrite(_chat(_video(MP4), **{"mm_processor_kwargs": KWARGS}), family)
    assert handed == [(MP4, "video"), (MP4, "audio")]
    part = out["messages"][0]["content"][0]
    assert part == {"type": "video_url", "video_url": {"url": _url("video/mp4", MP4)},
                    "uuid": own_identifier(mm_hash(MP4), "video")}
    assert out["mm_processor_kwargs"] == KWARGS
    assert out["ec_transfer_params"] == {EC_PARAMS_KEY: {"items": {
        "video": [own_identifier(mm_hash(MP4), "video")], "audio": [own_identifier(mm_hash(MP4), "audio")]}}}


def test_every_item_of_such_a_chat_goes_as_its_file_and_is_listed_in_vllms_order() -> None:
    """vLLM adds a video's sound right after the video, so an audio part before it comes first and
    one after it last; images, audio files and videos all keep their bytes (a metadata-only item
    beside a pixels one is what vLLM 0.32 fails for Qwen3-Omni)."""
    body = _chat(AUDIO, _video(MP4), IMAGE, _video(WEBM), AUDIO, **{"mm_processor_kwargs": KWARGS})
    out, handed = _rewrite(body)
    content = out["messages"][0]["content"]
    assert [p["type"] for p in content[:5]] == ["audio_url", "video_url", "image_url", "video_url", "audio_url"]
    assert all("uuid" in p and p.get(p["type"]) for p in content[:5])
    ids = {data: {m: own_identifier(mm_hash(data), m) for m in ("image", "video", "audio")}
           for data in (PNG, MP4, WEBM, WAV)}
    assert out["ec_transfer_params"][EC_PARAMS_KEY]["items"] == {
        "audio": [ids[WAV]["audio"], ids[MP4]["audio"], ids[WEBM]["audio"], ids[WAV]["audio"]],
        "video": [ids[MP4]["video"], ids[WEBM]["video"]],
        "image": [ids[PNG]["image"]],
    }
    assert sorted(handed, key=repr) == sorted([(PNG, "image"), (MP4, "video"), (WEBM, "video"), (WAV, "audio"),
                                               (WAV, "audio"), (MP4, "audio"), (WEBM, "audio")], key=repr)


def test_without_a_video_or_when_false_the_chat_is_rewritten_as_without_it() -> None:
    """No video to take the sound of, or the key false (vLLM's default): nothing to interleave, so
    nothing changes: the key is dropped (vLLM would hash every uuid with it), no list; a pixel-free
    chat for Qwen2.5-Omni, Qwen3-Omni's video as its file + uuid as always."""
    for body in (_chat(AUDIO, IMAGE, **{"mm_processor_kwargs": KWARGS}),
                 _chat(_video(MP4), **{"mm_processor_kwargs": {"use_audio_in_video": False}})):
        out, handed = _rewrite(body)
        assert "mm_processor_kwargs" not in out and "ec_transfer_params" not in out
        assert all(p["type"].endswith("_embeds") for p in out["messages"][0]["content"][:-1])
        assert len(handed) == len(out["messages"][0]["content"]) - 1
    out, handed = _rewrite(_chat(_video(MP4), **{"mm_processor_kwargs": {"use_audio_in_video": False}}), QWEN3_OMNI)
    assert "mm_processor_kwargs" not in out and "ec_transfer_params" not in out and handed == [(MP4, "video")]
    assert out["messages"][0]["content"][0]["type"] == "video_url"


@pytest.mark.parametrize("value", [1, "true", None, [True]])
def test_a_value_that_is_not_a_boolean_is_refused_naming_the_key(value: Any) -> None:
    with pytest.raises(EPDError) as refused:
        check_chat_request(_chat(_video(MP4), **{"mm_processor_kwargs": {"use_audio_in_video": value}}),
                           trust_request_mm_kwargs=True)
    assert refused.value.where == "mm_processor_kwargs.use_audio_in_video"


def test_a_family_that_does_not_declare_it_refuses_it_before_any_hand_off() -> None:
    """A server older than the key, or a family vLLM takes it for not: refused, naming the key."""
    older = {**QWEN2_5_OMNI.describe()}
    older["epd"] = {k: v for k, v in older["epd"].items() if k != "audio_in_video"}
    plan = check_chat_request(_chat(_video(MP4), **{"mm_processor_kwargs": KWARGS}), trust_request_mm_kwargs=True)
    with pytest.raises(EPDError) as refused:
        check_contract(plan, EpdContract.from_model({"id": "omni", "family": older}))
    assert refused.value.where == "mm_processor_kwargs.use_audio_in_video"


def test_untrusted_it_is_refused_as_vllm_refuses_it_and_other_keys_beside_it_stay_refused() -> None:
    """A proxy without ``--trust-request-mm-kwargs`` refuses the key (vLLM without its flag of that
    name does); trusted, another key beside it is still one of the server's settings, refused for
    items that go as their files."""
    with pytest.raises(EPDError) as refused:
        check_chat_request(_chat(_video(MP4), **{"mm_processor_kwargs": KWARGS}))
    assert refused.value.where == "mm_processor_kwargs"
    with pytest.raises(EPDError, match="takes no per-request processor settings"):
        _rewrite(_chat(_video(MP4), **{"mm_processor_kwargs": {**KWARGS, "max_pixels": 10_000}}))
