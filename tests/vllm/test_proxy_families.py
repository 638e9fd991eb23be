"""Every family with an EPD contract through the proxy, as a user runs it: client ->
``encode-epd-proxy`` -> vLLM's OpenAI server (an EC consumer with ``EncodeServerECConnector``), with
encode-server and Redis beside them, a recording relay in front of vLLM. The list is
``encoders.FAMILIES``' families with an ``epd`` contract, so a new family cannot be left out: one
without a record in ``families.PROXY_CASES`` fails here.

Per family, one stack at a time (its tiny checkpoint, encode-server, one vLLM OpenAI server:
conftest's ``family_stack``, which the modules that prove a family again through the proxy share,
``test_proxy_settings.py``, ``test_proxy_audio.py``, ``test_proxy_qwen25_video.py`` and
``test_proxy_video.py``; its servers take per-request settings, this module's proxy does not but
where the family declares ``audio_in_video``): the chat's images (its audio files, for an audio
family; both for Qwen2.5-Omni and Qwen3-Omni; and a video, where the family takes video; one chat
mixing all three where it takes all three) through the proxy answer as plain vLLM does on the
pixels (the samples), each item in its modality's EPD mode (Qwen3-Omni: audio pixel-free, images
and videos pixels + uuid), the repeat is a hit in encode-server, and zeros stored under the items'
keys change the answer. The consumer keeps its tower, so it is also the oracle: the same chat sent
to it straight, with its pixels and no ``uuid``, is named by vLLM's own hash, which the store never
holds, so vLLM runs its own tower on the pixels and its own loader on the file (as
``test_image_families`` does in-process). Pixel-free families' tower-free consumers are proven in
``test_proxy.py``, ``test_proxy_qwen25_video.py``, ``test_tower_free_qwen3.py``,
``test_proxy_audio.py`` and ``test_qwen2_5_omni.py``.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.epd import EpdContract, rewrite_chat_request
from encode_client.keys import own_identifier, store_key

from tests.audios import make_audio
from tests.server import ServerProcess
from tests.videos import make_video
from tests.vllm.conftest import EPD_FAMILIES, REDIS_URL, metric, png, stored_value
from tests.vllm.epd_stack import FamilyStack, answer_text, chat, post_chat, video_file, video_url_part
from tests.vllm.families import PROXY_CASES

# Each family's stack starts one vLLM OpenAI server (20-140 s on the 2-core CI machine).
pytestmark = pytest.mark.timeout(600)


def test_every_family_with_an_epd_contract_has_a_proxy_case() -> None:
    """The records follow the registry: none missing, none for a family that has gone, a clip
    wherever the family takes video, images wherever it takes images, audio files wherever audio."""
    assert set(PROXY_CASES) == set(EPD_FAMILIES), "tests/vllm/families.py's PROXY_CASES against encoders.FAMILIES"
    for name, family in EPD_FAMILIES.items():
        assert ("video" in family.modalities) == (PROXY_CASES[name].clip is not None), name
        assert ("image" in family.modalities) == bool(PROXY_CASES[name].sizes), name
        assert ("audio" in family.modalities) == bool(PROXY_CASES[name].audio), name


@pytest.fixture
def stack(family_stack: FamilyStack) -> FamilyStack:
    """The family's stack (conftest's ``family_stack``: every family's, one at a time); its ``proxy``
    takes no ``mm_processor_kwargs`` but where the family declares ``audio_in_video``."""
    return family_stack


@pytest.fixture(scope="module")
def any_clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A clip for the families that take no video: it must be refused, not forwarded."""
    return video_file(tmp_path_factory.mktemp("proxy-any-clip"), 4, 2.0, 64, 64)


def _images(stack: FamilyStack, seed: int) -> list[bytes]:
    return [png(w, h, seed=seed + i) for i, (w, h) in enumerate(stack.case.sizes)]


def _audio_parts(stack: FamilyStack, seed: int) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The family's audio files (its case's), as ``audio_url`` parts."""
    files = [make_audio(s, r, c, f, seed=seed + i) for i, (s, r, c, f) in enumerate(stack.case.audio)]
    urls = [f"data:audio/{spec[3]};base64," + base64.b64encode(d).decode()
            for d, spec in zip(files, stack.case.audio, strict=True)]
    return [{"type": "audio_url", "audio_url": {"url": url}} for url in urls], files


def _media_chat(stack: FamilyStack, seed: int, kind: str) -> tuple[dict[str, Any], list[bytes]]:
    """The family's chat of ``kind`` and its items: its images, or its audio files."""
    if kind == "image":
        images = _images(stack, seed)
        return chat(images), images
    parts, files = _audio_parts(stack, seed)
    return chat([], *parts), files


def _encoded_and_hits(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return (metric(text, "encode_server_items_total", status="encoded"),
            metric(text, "encode_server_items_total", status="hit"))


def _through_the_proxy_as_plain_vllm(stack: FamilyStack, body: dict[str, Any], media: list[bytes], kind: str) -> None:
    """``body`` (whose items are ``media``, of ``kind`` "image" or "video") through the proxy: vLLM
    is sent each item named by its identifier (the mm_hash; ``video:`` before it for a video), in the
    family's mode; the answer is plain vLLM's on the pixels; the repeat answers alike from encode-server's cache."""
    encoded, hits = _encoded_and_hits(stack.server)
    mark = stack.relay.mark()
    first = answer_text(post_chat(stack.proxy.url, body))
    sent = stack.relay.since(mark)
    assert stack.relay.uuids_since(mark) == [own_identifier(mm_hash(d), kind) for d in media]
    if stack.pixel_free(kind):
        for data in media:
            assert base64.b64encode(data)[-64:] not in sent, f"{kind} bytes reached vLLM"
        assert f'"{kind}_embeds"'.encode() in sent and f'"{kind}_url"'.encode() not in sent
    else:
        for data in media:
            assert base64.b64encode(data)[-64:] in sent, f"the {kind} is in the request to vLLM"
        assert f'"{kind}_embeds"'.encode() not in sent
    assert _encoded_and_hits(stack.server) == (encoded + len(media), hits)

    assert answer_text(post_chat(stack.proxy.url, body)) == first, "the repeat answered otherwise"
    assert _encoded_and_hits(stack.server) == (encoded + len(media), hits + len(media)), "the repeat was not a hit"

    plain = answer_text(post_chat(stack.consumer["url"], body))  # no uuid: vLLM's own tower and loader
    print(f"\n{stack.family.name}, {len(media)} {kind}(s): through the proxy {first!r}, plain vLLM {plain!r}")
    assert first == plain


def test_images_through_the_proxy_answer_as_plain_vllm_and_the_repeat_is_a_hit(stack: FamilyStack) -> None:
    """An audio family's chat is of audio files, through the same proof (Qwen2.5-Omni: both chats)."""
    for kind in stack.kinds:
        body, media = _media_chat(stack, seed=400, kind=kind)
        _through_the_proxy_as_plain_vllm(stack, body, media, kind)


def test_a_video_through_the_proxy_answers_as_plain_vllm_or_is_refused_naming_its_part(
    stack: FamilyStack, any_clip: bytes
) -> None:
    """Where the family takes video: as for images, and zeros under the video's key change the
    answer. Where it does not: a 400 naming the part, and nothing reaches vLLM."""
    if "video" not in stack.family.modalities:
        mark = stack.relay.mark()
        first, _ = _media_chat(stack, seed=450, kind=stack.kinds[0])
        content = first["messages"][0]["content"]
        r = post_chat(stack.proxy.url, chat([], content[0], video_url_part(any_clip)))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages[0].content[1]", error
        assert "takes no video through the EPD path" in error["message"], error
        assert stack.relay.since(mark) == b"", "a refused request reached vLLM"
        return
    clip = stack.clips["chat"]
    _through_the_proxy_as_plain_vllm(stack, chat([], video_url_part(clip)), [clip], "video")
    fresh = stack.clips["fresh"]
    _zeros_under_the_keys(stack, chat([], video_url_part(fresh)), [fresh], "video")


def _zeros_under_the_keys(stack: FamilyStack, body: dict[str, Any], media: list[bytes], kind: str) -> None:
    """The negative control, for items vLLM has never been sent (its encoder cache keeps an item under
    its uuid): the request as the proxy rewrites it, sent to vLLM after each stored embedding is
    replaced by zeros of its shape, answers otherwise than plain vLLM on the pixels, so the answers
    through the proxy came from the store. (Through the proxy itself the hand-off would write the
    server's own embedding back over the zeros.)"""
    plain = answer_text(post_chat(stack.consumer["url"], body))
    store = redis.Redis.from_url(REDIS_URL)
    with Client(stack.server.url, response="json", timeout=60) as client:
        rewritten, results = rewrite_chat_request(body, client)
        fingerprint = str(client.model()["fingerprint"])
    assert len(results) == len(media)
    for result in results:
        zeros = stored_value(np.zeros(result.shape, dtype=np.float32), fingerprint, result.hash, result.meta)
        assert result.key == store_key(fingerprint, result.hash, prefix=stack.prefix, modality=kind)
        store.set(result.key, zeros)  # the key the hand-off wrote
    poisoned = answer_text(post_chat(stack.consumer["url"], rewritten))
    assert poisoned != plain, "zeros under the keys did not change the answer: vLLM did not read the store"


AUDIO_IN_VIDEO = {"use_audio_in_video": True}


def test_a_video_with_its_sound_answers_as_plain_vllm_where_the_family_takes_use_audio_in_video(
    stack: FamilyStack,
) -> None:
    """Where the contract declares ``audio_in_video`` (the Omni thinkers): a video with its own sound
    and ``use_audio_in_video``, through the proxy (both it and vLLM started with
    ``--trust-request-mm-kwargs``, which vLLM needs for the key), answers as plain vLLM on the file.
    vLLM was sent the file under the video's identifier, the key, and ``ec_transfer_params`` naming
    the video and its sound; both were handed off; zeros under both keys of a fresh clip (Opus in
    webm) change its answer. Any other family (its proxy untrusted): a 400
    naming the field, nothing sent to vLLM."""
    sound = make_video(8, 2.0, 56, 56, sound_rate=16_000, seed=7)
    body = chat([], video_url_part(sound), mm_processor_kwargs=AUDIO_IN_VIDEO)
    epd = stack.family.epd
    mark = stack.relay.mark()
    if epd is None or not epd.audio_in_video:
        r = post_chat(stack.proxy.url, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs", r.text
        assert stack.relay.since(mark) == b"", "a refused request reached vLLM"
        return
    encoded, _ = _encoded_and_hits(stack.server)
    sounds = metric(httpx.get(stack.proxy.url + "/metrics", timeout=10).text, "encode_epd_proxy_handoff_audios_total")
    first = answer_text(post_chat(stack.proxy.url, body))
    sent = stack.relay.since(mark)
    assert stack.relay.uuids_since(mark) == [own_identifier(mm_hash(sound), "video")]
    proxied = httpx.get(stack.proxy.url + "/metrics", timeout=10).text
    assert metric(proxied, "encode_epd_proxy_handoff_audios_total") == sounds + 1  # the video's sound
    assert base64.b64encode(sound)[-64:] in sent and b"use_audio_in_video" in sent
    assert b'"ec_transfer_params"' in sent and own_identifier(mm_hash(sound), "audio").encode() in sent
    assert _encoded_and_hits(stack.server)[0] == encoded + 2, "the video and its sound were not both handed off"
    plain = answer_text(post_chat(stack.consumer["url"], body))
    print(f"\n{stack.family.name}, a video with its sound: through the proxy {first!r}, plain vLLM {plain!r}")
    assert first == plain

    fresh = make_video(5, 2.0, 84, 56, sound_rate=24_000, seed=8, codec="libvpx-vp9")
    body = chat([], video_url_part(fresh, "video/webm"), mm_processor_kwargs=AUDIO_IN_VIDEO)
    plain = answer_text(post_chat(stack.consumer["url"], body))
    store = redis.Redis.from_url(REDIS_URL)
    with Client(stack.server.url, response="json", timeout=60) as client:
        rewritten, results = rewrite_chat_request(body, client, trust_request_mm_kwargs=True)
        fingerprint = str(client.model()["fingerprint"])
    assert [r.key for r in results] == [store_key(fingerprint, mm_hash(fresh), prefix=stack.prefix, modality=m)
                                        for m in ("video", "audio")]
    for result in results:
        store.set(result.key, stored_value(np.zeros(result.shape, dtype=np.float32), fingerprint, result.hash,
                                           result.meta))
    assert answer_text(post_chat(stack.consumer["url"], rewritten)) != plain, "zeros did not change the answer"


def test_zeros_stored_under_an_images_key_change_the_answer(stack: FamilyStack) -> None:
    """(An audio family: under its audio files' keys; Qwen2.5-Omni: both.)"""
    for kind in stack.kinds:
        body, media = _media_chat(stack, seed=500, kind=kind)
        _zeros_under_the_keys(stack, body, media, kind)


def test_a_chat_mixing_audio_an_image_and_a_video_answers_as_plain_vllm(stack: FamilyStack) -> None:
    """Where the family takes all three (Qwen2.5-Omni, Qwen3-Omni): one chat of an audio file, an
    image and a video (the one the video test sent) through the proxy answers as plain vLLM does on
    the files, each item handed off under its own identifier, in its mode in this chat: the bytes of
    none that goes pixel-free reach vLLM, and those of each that goes as pixels + uuid do."""
    name = stack.family.name
    if not {"image", "video", "audio"} <= set(stack.family.modalities):
        return
    (audio, *_), (sound, *_) = _audio_parts(stack, seed=600)
    image, clip = png(*stack.case.sizes[1], seed=600), stack.clips["chat"]
    body = chat([image], audio, video_url_part(clip))
    mark = stack.relay.mark()
    first = answer_text(post_chat(stack.proxy.url, body))
    sent = stack.relay.since(mark)
    assert sorted(stack.relay.uuids_since(mark)) == sorted(
        [own_identifier(mm_hash(image), "image"), own_identifier(mm_hash(sound), "audio"),
         own_identifier(mm_hash(clip), "video")])
    # in this chat (Qwen3-Omni: audio is pixel-free alone, here its file + uuid beside the image and video)
    contract = EpdContract.from_model({"id": name, "family": stack.family.describe()})
    modes = contract.modes_for({"image", "audio", "video"})
    for data, kind in ((image, "image"), (sound, "audio"), (clip, "video")):
        assert (base64.b64encode(data)[-64:] in sent) == (modes[kind] == "pixels_uuid"), f"{kind}: the wrong mode"
    plain = answer_text(post_chat(stack.consumer["url"], body))
    print(f"\n{stack.family.name}, audio + image + video: through the proxy {first!r}, plain vLLM {plain!r}")
    assert first == plain
