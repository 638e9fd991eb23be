"""The rewrite follows the served family's EPD mode, read from a real server's ``GET /v1/model``:
pixel-free (the built-in Qwen-style model: test_epd.py), pixels + uuid (a tiny InternVL), none (a
CLIP tower: a deployment error, 502 from the proxy). vLLM itself: tests/vllm/test_proxy_families.py."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.epd import EpdContractError, rewrite_chat_request
from encode_client.proxy import EPDProxy

from tests.images import image_bytes
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server
from tests.tiny.internvl import make_tiny_internvl
from tests.tiny_models import make_clip

pytestmark = pytest.mark.integration

PREFIX = f"test-epd-modes-{os.getpid()}"
IMAGES = [image_bytes("PNG", 64, 48, seed=11), image_bytes("JPEG", 200, 90, seed=12)]


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat() -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": _url(IMAGES[0], "image/png"), "detail": "high"}},
            {"type": "input_image", "image_url": _url(IMAGES[1], "image/jpeg")},
        ]}],
    }


@pytest.fixture(scope="module")
def internvl_server(
    tmp_path_factory: pytest.TempPathFactory, shared_redis_url: str, server_logs: Path
) -> Iterator[ServerProcess]:
    model = make_tiny_internvl(tmp_path_factory.mktemp("internvl"))
    proc = start_server("--model", str(model), "--redis-url", shared_redis_url, "--cache-prefix", PREFIX,
                        log_dir=server_logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), PREFIX)


def test_pixels_uuid_keeps_each_image_and_adds_its_identifier(
    internvl_server: ServerProcess, shared_redis_url: str
) -> None:
    body = _chat()
    with Client(internvl_server.url) as client:
        rewritten, results = rewrite_chat_request(body, client)
    parts = rewritten["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "compare"}
    # rebuilt from what was checked: the data: URL and the identifier, nothing else of the client's
    assert parts[1] == {"type": "image_url", "image_url": {"url": _url(IMAGES[0], "image/png")},
                        "uuid": mm_hash(IMAGES[0])}
    assert parts[2] == {"type": "input_image", "image_url": _url(IMAGES[1], "image/jpeg"), "uuid": mm_hash(IMAGES[1])}
    store = redis.Redis.from_url(shared_redis_url)
    for result in results:
        assert result.meta["image_num_patches"] >= 1
        assert store.exists(result.key), "the embedding is in the shared tier when the rewrite returns"


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(make_clip(tmp_path_factory.mktemp("clip"))), log_dir=server_logs)
    yield proc
    proc.stop()


def test_a_model_no_prefill_consumes_is_a_deployment_error(clip_server: ServerProcess) -> None:
    with Client(clip_server.url) as client, pytest.raises(EpdContractError, match="family clip"):
        rewrite_chat_request(_chat(), client)
    proxy = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [clip_server.url])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json=_chat(), timeout=60)
        assert r.status_code == 502 and r.json()["error"]["type"] == "encoder_error", r.text
        assert "no vLLM prefill consumes" in r.json()["error"]["message"]
        text_only = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=text_only, timeout=60)
        assert r.json()["error"]["type"] == "upstream_unavailable", "a request without images needs no contract"
    finally:
        proxy.shutdown()
        proxy.server_close()
