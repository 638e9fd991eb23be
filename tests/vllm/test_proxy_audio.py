"""Qwen2-Audio through the EPD proxy, proven by vLLM's OpenAI server: client -> encode-epd-proxy ->
a recording relay -> a tower-free EC consumer (``EncodeServerECConnector``, ``--limit-mm-per-prompt
'{"audio": 0}'``: vLLM builds no audio tower) serving a tiny Qwen2-Audio, with encode-server and
Redis beside them; plain vLLM with its audio tower, given the same files, is the oracle.

encode-server and the oracle are conftest's ``family_stack`` for Qwen2-Audio, shared with
``test_proxy_families.py``: its EC consumer keeps its audio tower, so a chat sent to it straight,
with its files and no ``uuid``, is named by vLLM's own hash, which the store never holds, and vLLM
runs its own loader and tower on the files. The tower-free consumer is this module's own, on the
stack's encode-server and Redis prefix.

The proxy hands each ``audio_url`` / ``input_audio`` part to encode-server and sends vLLM Qwen2-Audio's
metadata-only ``audio_embeds`` part (``audio_num_tokens``, the field its parser declares) named by
the file's identifier; no sample reaches vLLM. Zeros stored under the same keys change the answer,
so the consumer used the store's rows and not anything of its own.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import mm_hash
from encode_client.keys import store_key
from encode_client.proxy import EPDProxy

from tests.audios import make_audio
from tests.server import ServerProcess
from tests.vllm.conftest import REDIS_URL, metric, on_family_stacks, running_proxy, stored_value
from tests.vllm.epd_stack import FamilyStack, Relay, answer_text, post_chat, vllm_openai_server

pytestmark = [pytest.mark.timeout(600), on_family_stacks("qwen2_audio")]
# (seconds, rate, channels, format): speech-like lengths at the rates people record at, two containers
CLIPS = [(1.0, 16_000, 1, "wav"), (3.7, 44_100, 2, "flac"), (12.34, 16_000, 1, "wav")]


@pytest.fixture(scope="module")
def clips() -> list[bytes]:
    return [make_audio(s, r, c, f, seed=i) for i, (s, r, c, f) in enumerate(CLIPS)]


@pytest.fixture(scope="module")
def server(family_stack: FamilyStack) -> ServerProcess:
    return family_stack.server


@pytest.fixture(scope="module")
def tower_free(family_stack: FamilyStack, logs: Path) -> Iterator[dict[str, Any]]:
    """The tower-free EC consumer of the stack's encode-server and prefix."""
    extra = {"redis_url": REDIS_URL, "encoder_url": family_stack.server.url, "prefix": family_stack.prefix}
    with vllm_openai_server(family_stack.model, extra, logs, limits={"audio": 0}) as running:
        yield running


@pytest.fixture(scope="module")
def vllms(tower_free: dict[str, Any], family_stack: FamilyStack) -> list[dict[str, Any]]:
    """The tower-free EC consumer, and the oracle: the stack's consumer, which keeps its audio tower."""
    return [tower_free, family_stack.consumer]


@pytest.fixture(scope="module")
def relay(tower_free: dict[str, Any]) -> Iterator[Relay]:
    with Relay(tower_free["port"]) as r:
        yield r


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [server.url]) as p:
        yield p


def _audio_url(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": f"data:audio/{fmt};base64," + base64.b64encode(data).decode()}}


def _input_audio(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "describe the sound"}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True}


def _sent_parts(sent: bytes) -> list[dict[str, Any]]:
    body = json.loads(sent[sent.index(b"\r\n\r\n") + 4:])
    return [p for p in body["messages"][0]["content"] if p["type"] == "audio_embeds"]


def test_audio_through_the_proxy_answers_as_plain_vllm_on_the_file(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, vllms: list[dict[str, Any]], clips: list[bytes]
) -> None:
    _, plain = vllms
    for (seconds, rate, channels, fmt), clip in zip(CLIPS, clips, strict=True):
        for part in (_audio_url(clip, fmt), _input_audio(clip, fmt)):
            mark = relay.mark()
            through_proxy = answer_text(post_chat(proxy.url, _chat(part)))
            sent = relay.since(mark)
            assert base64.b64encode(clip)[:64] not in sent, "audio bytes reached vLLM"
            (embeds,) = _sent_parts(sent)
            assert embeds["uuid"] == f"audio:{mm_hash(clip)}"
            counted = httpx.post(server.url + "/v1/tokens", timeout=30, json={
                "items": [{"data": base64.b64encode(clip).decode(), "modality": "audio"}]}).json()["items"][0]
            assert embeds["audio_embeds"] == {"audio_num_tokens": [counted["num_tokens"]]}
            on_the_file = answer_text(post_chat(plain["url"], _chat(part)))
            print(f"\n{seconds:g} s {rate} Hz {channels} ch {fmt} as {part['type']}: through the proxy "
                  f"{through_proxy!r}, plain vLLM {on_the_file!r}")
            assert through_proxy == on_the_file, (seconds, rate, fmt, part["type"])
    # two audio files in one chat, each its own item
    both = _chat(_audio_url(clips[0], "wav"), _input_audio(clips[1], "flac"))
    assert answer_text(post_chat(proxy.url, both)) == answer_text(post_chat(plain["url"], both))
    assert metric(httpx.get(proxy.url + "/metrics").text, "encode_epd_proxy_handoff_audios_total") >= 2 * len(clips) + 2


def test_zeros_in_the_store_change_the_answer(
    proxy: EPDProxy, server: ServerProcess, vllms: list[dict[str, Any]], family_stack: FamilyStack
) -> None:
    """The negative control: a file nobody has sent yet, whose store entry is zeros of its shape
    (written before its first request, so encode-server's hand-off finds it in Redis and the
    consumer reads it): the answer through the proxy is not plain vLLM's on the file. The test
    above can fail."""
    clip = make_audio(2.5, 16_000, seed=99)
    model = httpx.get(server.url + "/v1/model", timeout=10).json()
    counted = httpx.post(server.url + "/v1/tokens", timeout=30, json={
        "items": [{"data": base64.b64encode(clip).decode(), "modality": "audio"}]}).json()["items"][0]
    zeros = np.zeros((counted["num_tokens"], model["hidden_size"]), dtype=np.float32)
    h = mm_hash(clip)
    store = redis.Redis.from_url(REDIS_URL)
    key = store_key(model["fingerprint"], h, prefix=family_stack.prefix, modality="audio")
    store.set(key, stored_value(zeros, model["fingerprint"], h, counted["meta"]))
    request = _chat(_audio_url(clip, "wav"))
    with_zeros = answer_text(post_chat(proxy.url, request))
    on_the_file = answer_text(post_chat(vllms[1]["url"], request))
    print(f"\nzeros in the store: {with_zeros!r}; plain vLLM on the file: {on_the_file!r}")
    assert with_zeros != on_the_file


def test_an_audio_part_encode_server_refuses_is_a_400_naming_the_part(proxy: EPDProxy) -> None:
    r = post_chat(proxy.url, _chat({"type": "text", "text": "t"}, _audio_url(b"not audio at all", "wav")))
    assert r.status_code == 400, r.text
    assert "messages[0].content[1]" in r.text and "invalid_audio" in r.text
