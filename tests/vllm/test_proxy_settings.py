"""Per-request processor settings through EPD (issue 33), proved against vLLM: a chat's
``mm_processor_kwargs`` (Qwen2.5-VL's ``max_pixels``/``min_pixels``) through ``encode-epd-proxy`` ->
vLLM's OpenAI server (an EC consumer that keeps its tower, started with ``--trust-request-mm-kwargs``)
answers as plain vLLM answers the same chat on the pixels with the same kwargs; encode-server's
``/v1/tokens`` under the settings counts what vLLM's placeholder takes (its prompt length); one
image under two settings is two identifiers and two answers, each vLLM's own.

The consumer is also the oracle: the same chat sent to it straight, with its pixels and no
``uuid``, is named by vLLM's own hash (which the store never holds), so vLLM runs its own processor
with the kwargs and its own tower.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from encode_client import mm_hash
from encode_client.proxy import EPDProxy

from encode_server.core.settings import digest
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import REDIS_URL, metric, png, running_proxy
from tests.vllm.epd_stack import Relay, chat, post_chat, vllm_openai_server

PREFIX = f"test-vllm-proxy-settings-{os.getpid()}"
# vLLM's HF processor on its PIL backend (as the server's): a resized image's pixels then agree bit
# for bit, and so do the embeddings; a request's kwargs are merged over these by vLLM.
VLLM_ARGS = ("--trust-request-mm-kwargs", "--mm-processor-kwargs", json.dumps({"use_fast": False}))
pytestmark = pytest.mark.timeout(600)

# 280x280 is resized to 224x224 (the checkpoint's max_pixels): 64 rows; 112x112 under these: 16.
IMAGE = png(280, 280, seed=3300)
FEWER = {"max_pixels": 112 * 112}
OTHER = {"max_pixels": 168 * 168}


@dataclass(frozen=True)
class Stack:
    server: ServerProcess
    vllm: dict[str, Any]
    relay: Relay
    proxy: EPDProxy


@pytest.fixture(scope="module")
def stack(model_dir: Path, logs: Path) -> Iterator[Stack]:
    server = start_server("--model", str(model_dir), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX,
                          "--grpc-port", "0", "--dtype", "float32", "--trust-request-mm-kwargs", log_dir=logs)
    try:
        extra = {"redis_url": REDIS_URL, "encoder_url": server.url, "prefix": PREFIX}
        with (
            vllm_openai_server(model_dir, extra, logs, VLLM_ARGS, tower=True) as consumer,
            Relay(consumer["port"]) as relay,
            running_proxy(relay.url, [server.url], trust_request_mm_kwargs=True) as proxy,
        ):
            yield Stack(server, consumer, relay, proxy)
    finally:
        server.stop()
        delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


def _answer(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """The chat's text and its prompt's length (vLLM's placeholder rows are in it)."""
    r = post_chat(url, body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), int(r.json()["usage"]["prompt_tokens"])


def _identifier(stack: Stack, settings: dict[str, Any], data: bytes) -> str:
    """What the proxy must name the image by: the server's digest of the effective settings."""
    keys = httpx.get(stack.server.url + "/v1/model", timeout=10).json()["mm_processor_kwargs"]["keys"]
    effective = {name: key["default"] for name, key in keys.items()} | settings
    return f"p:{digest(effective)}:{mm_hash(data)}"


def _through_the_proxy(stack: Stack, settings: dict[str, Any] | None, data: bytes) -> tuple[str, int, list[str]]:
    body = chat([data], **({"mm_processor_kwargs": settings} if settings else {}))
    mark = stack.relay.mark()
    text, prompt_tokens = _answer(stack.proxy.url, body)
    sent = stack.relay.since(mark)
    assert b"image_url" not in sent and b'"image_embeds"' in sent  # pixel-free: metadata + uuid only
    assert b"mm_processor_kwargs" not in sent  # the grid carries their effect
    return text, prompt_tokens, stack.relay.uuids_since(mark)


def test_a_chat_with_max_pixels_through_the_proxy_answers_as_plain_vllm_given_the_same_kwargs(stack: Stack) -> None:
    text, prompt_tokens, uuids = _through_the_proxy(stack, FEWER, IMAGE)
    assert uuids == [_identifier(stack, FEWER, IMAGE)]
    plain_text, plain_tokens = _answer(stack.vllm["url"], chat([IMAGE], mm_processor_kwargs=FEWER))
    default_text, default_tokens = _answer(stack.vllm["url"], chat([IMAGE]))
    print(f"\nmax_pixels {FEWER['max_pixels']}: proxy {text!r} ({prompt_tokens} prompt tokens), plain vLLM "
          f"{plain_text!r} ({plain_tokens}); without the kwargs {default_text!r} ({default_tokens})")
    assert (text, prompt_tokens) == (plain_text, plain_tokens)
    assert default_tokens - plain_tokens == 64 - 16  # the setting took effect on both sides


@pytest.mark.parametrize(
    ("size", "settings"),
    [((280, 280), FEWER), ((280, 280), OTHER), ((640, 480), FEWER), ((100, 700), FEWER),
     ((56, 56), {"min_pixels": 112 * 112}), ((300, 200), {"min_pixels": 112 * 112, "max_pixels": 140 * 140})],
)
def test_tokens_under_the_settings_equal_vllms_placeholder_count_with_them(
    stack: Stack, size: tuple[int, int], settings: dict[str, Any]
) -> None:
    """vLLM's placeholder count, read from its prompt length: the prompt with the settings minus
    the prompt without is the rows with them minus the rows without (the rest of the prompt is the
    same text), and encode-server's count without them equals vLLM's (``test_tokens``)."""
    data = png(*size, seed=3310)

    def counted(given: dict[str, Any] | None) -> int:
        body = {"sizes": [list(size)], **({"mm_processor_kwargs": given} if given else {})}
        r = httpx.post(stack.server.url + "/v1/tokens", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["items"][0]["num_tokens"])

    _, with_settings = _answer(stack.vllm["url"], chat([data], mm_processor_kwargs=settings, max_tokens=1))
    _, without = _answer(stack.vllm["url"], chat([data], max_tokens=1))
    print(f"\n{size} {settings}: encode-server {counted(settings)} rows ({counted(None)} without); vLLM's prompt "
          f"{with_settings} tokens ({without} without)")
    assert counted(settings) - counted(None) == with_settings - without
    assert counted(settings) != counted(None)


def test_one_image_under_two_settings_gets_two_identifiers_and_two_answers_each_vllms(stack: Stack) -> None:
    """The collision the key's settings digest prevents: were the identifier the bytes' alone, the
    second setting would be served the first's embedding (vLLM's encoder cache and the store both
    keep an item under its identifier), with the first's row count."""
    data = png(280, 280, seed=3320)
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    encoded = metric(text, "encode_server_items_total", status="encoded")
    answers = {}
    for name, settings in (("fewer", FEWER), ("other", OTHER), ("default", None), ("fewer again", FEWER)):
        got_text, got_tokens, uuids = _through_the_proxy(stack, settings, data)
        plain = _answer(stack.vllm["url"], chat([data], **({"mm_processor_kwargs": settings} if settings else {})))
        print(f"\n{name}: proxy {got_text!r} ({got_tokens}), plain vLLM {plain[0]!r} ({plain[1]}), uuid {uuids}")
        assert (got_text, got_tokens) == plain, name
        answers[name] = (got_text, got_tokens, uuids[0])
    identifiers = {answers[n][2] for n in ("fewer", "other", "default")}
    assert len(identifiers) == 3 and answers["default"][2] == mm_hash(data)  # the defaults: today's identifier
    assert answers["fewer again"] == answers["fewer"]
    assert len({answers[n][1] for n in ("fewer", "other", "default")}) == 3  # three row counts
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    assert metric(text, "encode_server_items_total", status="encoded") == encoded + 3  # the repeat was a hit


def test_settings_the_family_refuses_are_a_400_naming_the_key_and_nothing_reaches_vllm(stack: Stack) -> None:
    mark = stack.relay.mark()
    for settings, param in (({"max_pixel": 5}, "mm_processor_kwargs.max_pixel"),
                            ({"max_pixels": "5"}, "mm_processor_kwargs.max_pixels")):
        r = post_chat(stack.proxy.url, chat([IMAGE], mm_processor_kwargs=settings))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert stack.relay.since(mark) == b""
