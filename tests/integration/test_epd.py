"""The EPD request path against a real server: the client's hand-off, the chat-request rewrite,
the proxy's errors, and the hand-off to ``--export-dir`` alone. (vLLM itself: tests/vllm.)"""

from __future__ import annotations

import base64
import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from encode_client import Client, ServerError, mm_hash
from encode_client.epd import EPDError, rewrite_chat_request
from encode_client.proxy import EPDProxy

from tests.images import image_bytes
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server

pytestmark = pytest.mark.integration

PREFIX = "test-epd"
IMAGES = [image_bytes("PNG", 64, 48, seed=1), image_bytes("JPEG", 90, 120, seed=2)]


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat() -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": _url(IMAGES[0])}},
                    {"type": "image_url", "image_url": _url(IMAGES[1], "image/jpeg")},  # the string form
                ],
            },
        ],
    }


@pytest.fixture(scope="module")
def server(shared_redis_url: str, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--redis-url", shared_redis_url, "--cache-prefix", PREFIX, log_dir=server_logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), PREFIX)


def test_rewrite_replaces_each_image_by_uuid_and_grid(server: ServerProcess, shared_redis_url: str) -> None:
    body = _chat()
    original = copy.deepcopy(body)
    with Client(server.url) as client:
        rewritten, results = rewrite_chat_request(body, client)
        again, second = rewrite_chat_request(body, client)
    assert body == original, "the caller's request is not changed"
    parts = rewritten["messages"][1]["content"]
    assert parts[0] == {"type": "text", "text": "compare"}
    assert rewritten["messages"][0] == original["messages"][0]
    store = redis.Redis.from_url(shared_redis_url)
    for part, data, result in zip(parts[1:], IMAGES, results, strict=True):
        assert part["type"] == "image_embeds" and part["uuid"] == mm_hash(data)
        assert part["image_embeds"] == {"image_grid_thw": result.meta["image_grid_thw"]}
        assert store.exists(result.key), "the embedding is in the shared tier when the rewrite returns"
    assert b"base64" not in repr(rewritten).encode()
    assert [r.status for r in results] == ["encoded", "encoded"]
    assert again == rewritten and [r.status for r in second] == ["hit", "hit"]


@pytest.mark.parametrize(
    ("url", "where", "words"),
    [
        ("http://example.com/cat.png", "messages[1].content[1]", "only data: URLs"),
        ("data:image/png,rawbytes", "messages[1].content[1]", "must be base64"),
        ("data:image/png;base64,%%%", "messages[1].content[1]", "not valid base64"),
    ],
)
def test_unreadable_parts_are_named(server: ServerProcess, url: str, where: str, words: str) -> None:
    body = _chat()
    body["messages"][1]["content"][1]["image_url"]["url"] = url
    with Client(server.url) as client, pytest.raises(EPDError, match=words) as info:
        rewrite_chat_request(body, client)
    assert info.value.where == where


def test_a_request_without_images_is_left_alone(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with Client(server.url) as client:
        assert rewrite_chat_request(body, client) == (body, [])


@pytest.fixture()
def proxy_to_nowhere() -> Iterator[EPDProxy]:
    """A proxy whose encode-server and vLLM are both ports where nothing listens."""
    proxy = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [f"http://127.0.0.1:{free_port()}"])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def test_proxy_errors_are_openai_shaped(proxy_to_nowhere: EPDProxy) -> None:
    url = proxy_to_nowhere.url
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/chat/completions", json=_chat(), timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "encoder_unavailable"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 502


def test_hand_off_to_the_export_dir_alone(tmp_path: Path, server_logs: Path) -> None:
    """No Redis: the files are the shared tier, on disk when the answer comes."""
    export = tmp_path / "ec"
    proc = start_server("--export-dir", str(export), "--export-max-mb", "16", log_dir=server_logs)
    try:
        with Client(proc.url) as client:
            results = client.hand_off(IMAGES)
            for data, result in zip(IMAGES, results, strict=True):
                assert (export / mm_hash(data) / "encoder_cache.safetensors").is_file()
                assert result.data == b"" and result.meta["image_grid_thw"]
            assert (export / "FINGERPRINT").read_text().strip() == client.model()["fingerprint"]
    finally:
        proc.stop()
    bare = start_server(log_dir=server_logs)
    try:
        with Client(bare.url) as client, pytest.raises(ServerError) as info:
            client.hand_off(IMAGES[:1])
        assert info.value.status == 409 and info.value.type == "no_shared_tier"
    finally:
        bare.stop()
