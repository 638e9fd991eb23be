"""A family whose modalities vLLM takes in different EPD modes (Qwen3-Omni's thinker: audio
pixel-free, images and videos pixels + uuid): the contract ``GET /v1/model`` publishes for it, how
this client reads it, and each part of a chat rewritten in its modality's mode, the audio as its
file + uuid beside an image or a video (``pixel_free_alone``: vLLM 0.32 fails metadata-only audio
there) (pure)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import Result, mm_hash
from encode_client.epd import (
    EpdContract,
    EpdContractError,
    EPDError,
    apply_results,
    check_chat_request,
    check_contract,
)
from encode_client.keys import own_identifier

from encode_server.core.hashing import cache_key
from encode_server.encoders import FAMILIES
from encode_server.encoders.family import EPD_MODES, Epd
from encode_server.encoders.qwen3_omni import FAMILY

FP = "ab" * 32
PNG, MP4, WAV = b"\x89PNG not decoded", b"\x00\x00\x00\x18ftypmp4 not decoded", b"RIFF not decoded"


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMAGE = {"type": "image_url", "image_url": {"url": _url("image/png", PNG)}}
VIDEO = {"type": "video_url", "video_url": {"url": _url("video/mp4", MP4)}}
AUDIO = {"type": "audio_url", "audio_url": {"url": _url("audio/wav", WAV)}}
INPUT_AUDIO = {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"}}


def _model(epd: dict[str, Any]) -> dict[str, Any]:
    return {"id": "omni", "family": {"name": "qwen3_omni", "modalities": ["image", "video", "audio"], "epd": epd}}


def _contract() -> EpdContract:
    return EpdContract.from_model({"id": "omni", "family": FAMILY.describe()})


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "t"}]}]}


def _answer(data: bytes, modality: str, meta: dict[str, Any]) -> Result:
    h = mm_hash(data)
    return Result(0, h, "encoded", None, 4, (), None, meta=meta, key=cache_key(FP, h, prefix="e", modality=modality))


def test_the_family_publishes_each_modalitys_mode_under_a_mode_older_clients_do_not_know() -> None:
    """``mode`` is ``per_modality``, not one of the two an older client reads (it refuses the
    contract: ``EpdContractError``, never a part in the wrong mode); ``modes`` names every modality
    the family takes; fields only for the pixel-free one."""
    epd = FAMILY.describe()["epd"]
    assert epd["mode"] == "per_modality" and epd["mode"] not in EPD_MODES
    assert epd["modes"] == {"image": "pixels_uuid", "video": "pixels_uuid", "audio": "pixel_free"}
    assert epd["fields"] == {"audio": ["audio_feature_lengths"]}
    assert set(epd["modes"]) == set(FAMILY.modalities)
    assert epd["pixel_free_alone"] == ["audio"]


def test_every_other_family_publishes_its_contract_as_before() -> None:
    """One mode a family: no ``modes`` key, ``mode`` one of the two every client knows."""
    for family in FAMILIES:
        if family.epd is not None and family is not FAMILY:
            assert not family.epd.per_modality and "modes" not in family.describe()["epd"], family.name
            assert "pixel_free_alone" not in family.describe()["epd"], family.name
            assert family.describe()["epd"]["mode"] in EPD_MODES, family.name


def test_a_per_modality_contract_is_well_formed() -> None:
    with pytest.raises(ValueError, match="pixel-free audio must name the fields"):
        Epd("pixels_uuid", modes={"audio": "pixel_free"})
    with pytest.raises(ValueError, match="mode must be one of"):
        Epd("pixels_uuid", {"audio": ("audio_feature_lengths",)}, modes={"audio": "tower"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="only a pixel-free modality can be pixel-free alone"):
        Epd("pixels_uuid", {"audio": ("audio_feature_lengths",)}, modes={"audio": "pixel_free"}, alone=("image",))
    with pytest.raises(ValueError, match=r"fields are named for \['image'\]"):
        Epd("pixels_uuid", {"audio": ("audio_feature_lengths",), "image": ("image_grid_thw",)},
            modes={"audio": "pixel_free"})


def test_this_client_reads_each_modalitys_mode() -> None:
    contract = _contract()
    assert contract.mode == "per_modality"
    assert [contract.mode_of(m) for m in ("image", "video", "audio")] == ["pixels_uuid", "pixels_uuid", "pixel_free"]
    assert contract.fields == {"audio": ("audio_feature_lengths",)}
    assert contract.pixel_free_alone == {"audio"}
    assert contract.modes_for({"audio"}) == {"audio": "pixel_free"}
    assert contract.modes_for({"audio", "video"}) == {"audio": "pixels_uuid", "video": "pixels_uuid"}
    # one mode a family: as before (a pixels + uuid family takes images only, a pixel-free one its fields')
    internvl = EpdContract("pixels_uuid", {})
    qwen2_audio = EpdContract("pixel_free", {"audio": ("audio_num_tokens",)})
    assert [internvl.mode_of(m) for m in ("image", "video", "audio")] == ["pixels_uuid", None, None]
    assert [qwen2_audio.mode_of(m) for m in ("image", "video", "audio")] == [None, None, "pixel_free"]


@pytest.mark.parametrize(
    ("epd", "words"),
    [
        ({"mode": "per_modality", "fields": {}}, "modes this client does not know"),
        ({"mode": "per_modality", "fields": {}, "modes": {"audio": "tower"}}, "modes this client does not know"),
        ({"mode": "per_modality", "fields": {}, "modes": {"audio": "pixel_free"}},
         r"no fields for pixel-free \['audio'\]"),
    ],
)
def test_a_per_modality_contract_this_client_cannot_follow_is_a_deployment_error(epd: dict[str, Any],
                                                                                  words: str) -> None:
    with pytest.raises(EpdContractError, match=words):
        EpdContract.from_model(_model(epd))


RESULTS = {"image": _answer(PNG, "image", {"image_grid_thw": [1, 6, 10]}),
           "video": _answer(MP4, "video", {"video_grid_thw": [2, 24, 24]}),
           "audio": _answer(WAV, "audio", {"audio_feature_lengths": [233]})}


def _rewritten(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    body = _chat(*parts)
    plan = check_chat_request(body)
    contract = _contract()
    check_contract(plan, contract)
    results = [RESULTS[part.modality] for part in plan.media]
    return apply_results(body, plan, results, contract)["messages"][0]["content"]


@pytest.mark.parametrize("audio", [AUDIO, INPUT_AUDIO])
def test_audio_alone_is_a_metadata_only_item(audio: dict[str, Any]) -> None:
    """Without an image or a video in the chat: ``audio_embeds`` (its samples gone), the server's key's identifier."""
    out = _rewritten(audio, AUDIO)
    for part in out[:2]:
        assert part == {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [233]},
                        "uuid": own_identifier(mm_hash(WAV), "audio")}
    assert base64.b64encode(WAV).decode() not in str(out)


def test_images_and_videos_keep_their_data_urls_with_the_identifier() -> None:
    out = _rewritten(IMAGE, VIDEO)
    assert out[0] == {**IMAGE, "uuid": own_identifier(mm_hash(PNG), "image")}
    assert out[1] == {**VIDEO, "uuid": own_identifier(mm_hash(MP4), "video")}


@pytest.mark.parametrize("audio", [AUDIO, INPUT_AUDIO])
def test_beside_an_image_or_a_video_the_audio_goes_as_its_file_and_identifier(audio: dict[str, Any]) -> None:
    """``pixel_free_alone``: vLLM 0.32 fails metadata-only audio beside raw vision items, so in
    such a chat every part keeps its file (the audio as the client sent it, nothing else of its
    keys) and gets its identifier; the connector supplies every item's rows."""
    for vision in (IMAGE, VIDEO):
        out = _rewritten(audio, vision)
        assert out[0] == {**audio, "uuid": own_identifier(mm_hash(WAV), "audio")}
        assert "audio_embeds" not in str(out)
    out = _rewritten(audio, IMAGE, VIDEO)
    assert [part["type"] for part in out[:3]] == [audio["type"], "image_url", "video_url"]


def test_settings_on_a_pixels_and_uuid_item_are_refused_before_any_hand_off() -> None:
    """vLLM hashes a uuid with per-request settings, so a pixels + uuid item under them would never
    be read from the store: refused, here for the video as for the image (the family declares no
    settings, so the key is refused first whatever the item)."""
    contract = EpdContract("per_modality", {"audio": ("audio_feature_lengths",)}, settings_enabled=True,
                           settings={"fps": {"type": "float", "modalities": ["video"],
                                             "vllm_field": "media_io_kwargs.video"}},
                           modes={"audio": "pixel_free", "image": "pixels_uuid", "video": "pixels_uuid"})
    plan = check_chat_request({**_chat(VIDEO), "media_io_kwargs": {"video": {"fps": 4.0}}},
                              trust_request_mm_kwargs=True)
    with pytest.raises(EPDError, match="pixels \\+ uuid") as refused:
        check_contract(plan, contract)
    assert refused.value.where == "media_io_kwargs.video"


def test_a_modality_the_contract_does_not_name_is_refused_naming_the_part() -> None:
    contract = EpdContract("per_modality", {"audio": ("audio_feature_lengths",)},
                           modes={"audio": "pixel_free", "image": "pixels_uuid"})
    with pytest.raises(EPDError, match="names no video") as refused:
        check_contract(check_chat_request(_chat(IMAGE, VIDEO)), contract)
    assert refused.value.where == "messages[0].content[1]"
    audio_as_pixels = EpdContract("per_modality", {}, modes={"audio": "pixels_uuid", "image": "pixels_uuid"})
    with pytest.raises(EPDError, match="forwards no audio file"):
        check_contract(check_chat_request(_chat(AUDIO)), audio_as_pixels)
    # without pixel_free_alone, audio beside an image is not forwarded as a file either: it stays pixel-free
    plain = EpdContract("per_modality", {"audio": ("audio_feature_lengths",)},
                        modes={"audio": "pixel_free", "image": "pixels_uuid"})
    assert plain.modes_for({"audio", "image"}) == {"audio": "pixel_free", "image": "pixels_uuid"}
