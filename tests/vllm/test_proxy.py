"""The EPD path over HTTP: client -> encode-epd-proxy -> vLLM's OpenAI server (an EC consumer with
``EncodeServerECConnector``), with encode-server and Redis beside them, all on loopback.

A recording TCP relay sits between the proxy and vLLM, so the test sees every byte the prefill
server received: no image bytes, only ``uuid`` + ``image_grid_thw``. The consumer is tower-free (the
documented setup); plain vLLM with its tower answers the same chat on the pixels.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from encode_client import mm_hash
from encode_client.proxy import EPDProxy

from tests.server import ServerProcess
from tests.vllm.conftest import metric, png, running_proxy
from tests.vllm.epd_stack import Relay, chat, chat_text

IMAGES = [png(56, 56, seed=70), png(112, 84, seed=71)]  # not resized: vLLM's own encode is exact too


@pytest.fixture(scope="module")
def server(epd_server: ServerProcess) -> ServerProcess:
    return epd_server


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [server.url]) as p:
        yield p


def _post(url: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r, (time.perf_counter() - started) * 1000


def _encoded_and_hits(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return (
        metric(text, "encode_server_items_total", status="encoded"),
        metric(text, "encode_server_items_total", status="hit"),
    )


def test_chat_through_the_proxy_sends_no_pixels_to_vllm(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, plain_vllm: dict[str, Any]
) -> None:
    encoded, hits, mark = *_encoded_and_hits(server), relay.mark()
    first, first_ms = _post(proxy.url, chat(IMAGES))
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    assert first.json()["usage"]["completion_tokens"] == 8

    sent = relay.since(mark)
    hashes = [mm_hash(d) for d in IMAGES]
    assert b"/v1/chat/completions" in sent
    for data, h in zip(IMAGES, hashes, strict=True):
        payload = base64.b64encode(data)
        assert payload[:64] not in sent and payload[-64:] not in sent, "image bytes reached the prefill server"
        assert h.encode() in sent
    assert b"image_url" not in sent and b"image_embeds" in sent and b"image_grid_thw" in sent

    assert _encoded_and_hits(server) == (encoded + len(IMAGES), hits)

    second, second_ms = _post(proxy.url, chat(IMAGES))
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"] == answer
    assert _encoded_and_hits(server) == (encoded + len(IMAGES), hits + len(IMAGES))

    # The same request with its pixels, straight to plain vLLM: it encodes the images with its tower.
    direct, direct_ms = _post(plain_vllm["url"], chat(IMAGES))
    assert direct.status_code == 200, direct.text
    assert direct.json()["choices"][0]["message"]["content"] == answer
    print(
        f"\nchat request with {len(IMAGES)} images: via proxy {first_ms:.0f} ms (encoded), "
        f"{second_ms:.0f} ms (cached); straight to vLLM with pixels {direct_ms:.0f} ms"
    )


def test_streaming_passes_through(proxy: EPDProxy) -> None:
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=chat(IMAGES[:1], stream=True), timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 3


def test_unreadable_image_is_a_400_naming_the_part(proxy: EPDProxy) -> None:
    body = chat(IMAGES[:1])
    body["messages"][0]["content"].insert(1, {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}})
    r, _ = _post(proxy.url, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    assert "data: URLs" in r.json()["error"]["message"]
    body = chat(IMAGES[:1])
    body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,@@@"
    r, _ = _post(proxy.url, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"


def test_an_embedding_only_in_encode_servers_local_tier_still_answers(
    server: ServerProcess, vllm_server: dict[str, Any], plain_vllm: dict[str, Any]
) -> None:
    """The issue's case over HTTP: the embedding deleted from Redis, still in encode-server's
    local tier; the metadata-only chat sent straight to the tower-free consumer (no proxy, so no
    second hand-off refills Redis) is answered, equal to plain vLLM's answer on the pixels
    (before the fallback: 500 InternalServerError)."""
    import redis
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request

    from tests.vllm.conftest import REDIS_URL

    image = png(112, 84, seed=72)
    with Client(server.url, response="json") as client:
        rewritten, results = rewrite_chat_request(chat([image]), client)
    assert redis.Redis.from_url(REDIS_URL).delete(results[0].key) == 1
    r, _ = _post(vllm_server["url"], rewritten)
    assert r.status_code == 200, r.text
    direct, _ = _post(plain_vllm["url"], chat([image]))
    assert r.json()["choices"][0]["message"]["content"] == direct.json()["choices"][0]["message"]["content"]


def test_vllms_own_failure_is_what_the_proxy_retries(server: ServerProcess, vllm_server: dict[str, Any]) -> None:
    """The answers of the real tower-free consumer for an image no tier holds (Redis nor
    encode-server), streamed and not, are what the proxy's retry recognises (and what
    tests/proxy_upstream.py plays)."""
    from encode_client._vllm_failure import StreamGate, is_generation_error

    unknown = png(56, 56, seed=73)
    body = {**chat([]), "messages": [{"role": "user", "content": [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": mm_hash(unknown)},
        {"type": "text", "text": "describe the image"}]}]}
    r, _ = _post(vllm_server["url"], body)
    assert is_generation_error(r.status_code, r.content), (r.status_code, r.text)
    gate = StreamGate()
    with httpx.stream("POST", vllm_server["url"] + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as streamed:
        assert streamed.status_code == 200
        for chunk in streamed.iter_raw():
            gate.feed(chunk)
    assert gate.failed, "vLLM's streamed failure was not recognised"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_embedding_lost_between_hand_off_and_prefill_is_retried(
    model_dir: Any, logs: Any, vllm_server: dict[str, Any], plain_vllm: dict[str, Any], stream: bool
) -> None:
    """Redis loses the value after the proxy handed the image off (a relay deletes the key as the
    request goes to vLLM) and no E holds it (the proxy's encode-server has no local tier): vLLM
    fails the request; the proxy hands the image off again (re-encoded) and retries; the user gets
    plain vLLM's answer on the pixels."""

    import redis

    from tests.server import start_server
    from tests.vllm.conftest import EPD_PREFIX, REDIS_URL

    store = redis.Redis.from_url(REDIS_URL)
    lost: list[str] = []

    def evict_once(chunk: bytes) -> None:
        if not lost and b'"uuid"' in chunk:
            keys = list(store.scan_iter(f"{EPD_PREFIX}:*{mm_hash(image)}"))
            lost.extend(k.decode() for k in keys)
            store.delete(*keys)

    image = png(112, 84, seed=74 + stream)
    lone = start_server(
        "--model", str(model_dir), "--redis-url", REDIS_URL, "--cache-prefix", EPD_PREFIX, "--grpc-port", "0",
        "--dtype", "float32", "--cache-mb", "0", log_dir=logs,
    )
    evicting = Relay(vllm_server["port"], before_forward=evict_once)
    evicting.start()
    try:
        with running_proxy(evicting.url, [lone.url]) as proxy:
            text = chat_text(proxy.url, chat([image], stream=stream), stream=stream)
            metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        assert lost, "the relay evicted the value"
        assert metric(metrics, "encode_epd_proxy_retries_total", reason="prefill_error") == 1
        assert evicting.since(0).count(b"POST /v1/chat/completions") == 2
        assert text == plain_answer(plain_vllm, image)
    finally:
        evicting.close()
        lone.stop()


def plain_answer(plain_vllm: dict[str, Any], image: bytes) -> str:
    r, _ = _post(plain_vllm["url"], chat([image]))
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])
