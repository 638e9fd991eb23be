"""The EPD rewrite of audio parts, without I/O: ``audio_url`` and OpenAI's ``input_audio`` parts are
audio items, a family must declare pixel-free audio fields to take one, and vLLM gets Qwen2-Audio's
metadata-only ``audio_embeds`` part (the hand-off's answers given as values)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import Result, mm_hash
from encode_client.epd import EpdContract, EPDError, apply_results, check_chat_request, check_contract

from encode_server.core.hashing import cache_key

WAV = b"RIFF\x24\x00\x00\x00WAVEfmt  not decoded here"
PNG = b"\x89PNG\r\n\x1a\n not decoded here"
AUDIO_URL = "data:audio/wav;base64," + base64.b64encode(WAV).decode()
IMAGE_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
FP = "cd" * 32
QWEN2_AUDIO = EpdContract("pixel_free", {"audio": ("audio_num_tokens",)})
QWEN25_VL = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw",)})
GEMMA3 = EpdContract("pixels_uuid", {})


def body(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4}


def audio_url(url: Any = AUDIO_URL) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def input_audio(data: Any = None, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode() if data is None else data,
                                                   "format": fmt}}


def result(data: bytes, meta: dict[str, Any]) -> Result:
    h = mm_hash(data)
    key = cache_key(FP, h, prefix="encode", modality="audio")
    return Result(0, h, "encoded", None, 8, (), None, meta=meta, key=key)


def test_both_audio_part_forms_are_planned_in_request_order() -> None:
    plan = check_chat_request(body({"type": "text", "text": "t"}, audio_url(), input_audio(),
                                   {"type": "audio_url", "audio_url": AUDIO_URL}))
    assert [(p.where, p.modality, p.data) for p in plan.audios] == [
        ("messages[0].content[1]", "audio", WAV), ("messages[0].content[2]", "audio", WAV),
        ("messages[0].content[3]", "audio", WAV)]
    assert plan.media == plan.audios


def test_the_part_vllm_gets_is_metadata_and_the_audio_identifier_only() -> None:
    request = body(audio_url(), input_audio(), {"type": "text", "text": "what is it"})
    plan = check_chat_request(request)
    check_contract(plan, QWEN2_AUDIO)
    meta = {"audio_num_tokens": [92]}
    out = apply_results(request, plan, [result(WAV, meta), result(WAV, meta)], QWEN2_AUDIO)
    for part in out["messages"][0]["content"][:2]:
        assert part == {"type": "audio_embeds", "audio_embeds": {"audio_num_tokens": [92]},
                        "uuid": f"audio:{mm_hash(WAV)}"}
    assert out["messages"][0]["content"][2] == {"type": "text", "text": "what is it"}
    assert base64.b64encode(WAV).decode() not in str(out)


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (audio_url("http://example.com/a.wav"), "only data: URLs"),
        (audio_url("data:audio/wav,plain"), "data:audio/wav;base64"),
        (audio_url("data:audio/wav;base64,@@@"), "not valid base64"),
        (audio_url(None), "audio_url.url must be a string"),
        (input_audio("@@@"), "input_audio.data is not valid base64"),
        ({"type": "input_audio", "input_audio": "x"}, "input_audio.data must be a base64 string"),
        ({**audio_url(), "uuid": "mine"}, "a client's uuid is refused"),
        ({"type": "audio_embeds", "audio_embeds": {"audio_num_tokens": 3}}, "audio_embeds parts from clients"),
    ],
)
def test_a_bad_audio_part_is_refused_naming_it(part: dict[str, Any], words: str) -> None:
    with pytest.raises(EPDError, match=words) as info:
        check_chat_request(body({"type": "text", "text": "t"}, part))
    assert info.value.where == "messages[0].content[1]"


@pytest.mark.parametrize(("contract", "part", "words"), [
    (QWEN25_VL, audio_url(), "takes no audio through the EPD path: its EPD contract declares no pixel-free audio"),
    (GEMMA3, input_audio(), "takes no audio through the EPD path: its EPD mode is pixels \\+ uuid"),
    (QWEN2_AUDIO, {"type": "image_url", "image_url": {"url": IMAGE_URL}}, "takes no image through the EPD path"),
])
def test_an_item_the_family_cannot_take_is_refused_before_any_hand_off(
    contract: EpdContract, part: dict[str, Any], words: str
) -> None:
    plan = check_chat_request(body(part))
    with pytest.raises(EPDError, match=words) as info:
        check_contract(plan, contract)
    assert info.value.where == "messages[0].content[0]"
