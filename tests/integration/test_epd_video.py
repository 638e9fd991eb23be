"""The EPD rewrite of video parts against real servers: a tiny Qwen3-VL with tenant isolation (the
video part vLLM gets, named by its tenant's store key; a video the server refuses named by its
part) and the built-in model, whose family takes no video (refused before anything moves).
vLLM itself: tests/vllm/test_proxy_video.py."""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.epd import EPDError, rewrite_chat_request
from encode_client.keys import store_key, tenant_digest
from encode_client.proxy import EPDProxy

from tests import tiny_models
from tests.images import image_bytes
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server
from tests.videos import make_video

pytestmark = pytest.mark.integration

PREFIX = f"test-epd-video-{os.getpid()}"
KEY = "acme-key"
IMAGE = image_bytes("PNG", 64, 64, seed=31)
VIDEO = make_video(4, 2.0, 64, 64)  # 2 s: 4 frames, 2 groups


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat(video: bytes) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _url(IMAGE, "image/png")}},
        {"type": "video_url", "video_url": {"url": _url(video, "video/mp4")}},
        {"type": "text", "text": "what happens?"},
    ]}]}


@pytest.fixture(scope="module")
def qwen3_server(
    tmp_path_factory: pytest.TempPathFactory, shared_redis_url: str, server_logs: Path
) -> Iterator[ServerProcess]:
    model = tiny_models.make_qwen3(tmp_path_factory.mktemp("qwen3_epd_video"))
    proc = start_server("--model", str(model), "--redis-url", shared_redis_url, "--cache-prefix", PREFIX,
                        "--tenant-isolation", "--api-keys", f"acme:{KEY}", log_dir=server_logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), PREFIX)


def test_a_video_part_becomes_video_embeds_named_by_its_tenants_key(
    qwen3_server: ServerProcess, shared_redis_url: str
) -> None:
    with Client(qwen3_server.url, api_key=KEY) as client:
        fingerprint = client.model()["fingerprint"]
        rewritten, results = rewrite_chat_request(_chat(VIDEO), client)
        again, hits = rewrite_chat_request(_chat(VIDEO), client)
    tokens = httpx.post(qwen3_server.url + "/v1/tokens", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"items": [{"data": base64.b64encode(VIDEO).decode(), "modality": "video"}]})
    meta = tokens.json()["items"][0]["meta"]
    digest = tenant_digest("acme")
    assert rewritten["messages"][0]["content"][1] == {
        "type": "video_embeds",
        "video_embeds": {"video_grid_thw": meta["video_grid_thw"], "timestamps": meta["timestamps"]},
        "uuid": f"t:{digest}:video:{mm_hash(VIDEO)}",
    }
    assert rewritten["messages"][0]["content"][0]["uuid"] == f"t:{digest}:{mm_hash(IMAGE)}"
    assert [r.status for r in results] == ["encoded", "encoded"] and [r.status for r in hits] == ["hit", "hit"]
    assert again == rewritten
    store = redis.Redis.from_url(shared_redis_url)
    assert store.exists(store_key(fingerprint, mm_hash(VIDEO), prefix=PREFIX, tenant="acme", modality="video"))


def test_a_video_the_server_refuses_is_named_by_its_part(qwen3_server: ServerProcess) -> None:
    with Client(qwen3_server.url, api_key=KEY) as client, pytest.raises(EPDError) as info:
        rewrite_chat_request(_chat(VIDEO[: len(VIDEO) // 3]), client)
    assert info.value.where == "messages[0].content[1]"
    assert "encode-server refused this video: 400 invalid_video" in str(info.value)


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    """A family that takes images only, and those with pixels + uuid (LLaVA-1.5)."""
    proc = start_server("--model", str(tiny_models.make_llava(tmp_path_factory.mktemp("llava_epd_video"))),
                        log_dir=server_logs)
    yield proc
    proc.stop()


@pytest.fixture()
def proxy(llava_server: ServerProcess) -> Iterator[EPDProxy]:
    """A proxy to an images-only model, whose vLLM is a port where nothing listens."""
    p = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [llava_server.url])
    threading.Thread(target=p.serve_forever, daemon=True).start()
    yield p
    p.shutdown()
    p.server_close()


def _items(server: ServerProcess) -> str:
    return "\n".join(line for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
                     if line.startswith("encode_server_items_total"))


def test_a_video_for_a_family_without_video_is_a_400_before_anything_moves(
    proxy: EPDProxy, llava_server: ServerProcess
) -> None:
    before = _items(llava_server)
    r = httpx.post(proxy.url + "/v1/chat/completions", json=_chat(VIDEO), timeout=60)
    assert r.status_code == 400, r.text  # not 502: vLLM was never asked
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages[0].content[1]")
    assert "takes no video through the EPD path" in error["message"]
    assert _items(llava_server) == before, "neither the image nor the video was handed off"


def _status(server: ServerProcess, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("encode_server_items_total{") and f'status="{status}"' in line)


def test_a_request_with_only_a_video_that_vllm_failed_is_handed_off_again_and_retried(
    qwen3_server: ServerProcess,
) -> None:
    """vLLM (played by a stub: a real one cannot be made to fail on demand; tests/vllm/test_proxy_video.py
    has vLLM itself) fails the first try as its EC connector does: the proxy hands the video off again
    and sends the same rewritten request again; the client gets the second answer."""
    from tests.proxy_upstream import StubVllm

    fresh = make_video(6, 3.0, 64, 64)
    body = {"model": "stub", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": _url(fresh, "video/mp4")}}, {"type": "text", "text": "what?"}]}]}
    with StubVllm() as stub:
        p = EPDProxy(("127.0.0.1", 0), stub.url, [qwen3_server.url], api_key=KEY)
        threading.Thread(target=p.serve_forever, daemon=True).start()
        try:
            stub.fail_next = 1
            encoded, hits = _status(qwen3_server, "encoded"), _status(qwen3_server, "hit")
            r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=60)
            metrics = httpx.get(p.url + "/metrics", timeout=10).text
        finally:
            p.shutdown()
            p.server_close()
    assert r.status_code == 200 and "InternalServerError" not in r.text, r.text
    assert len(stub.bodies) == 2 and stub.bodies[0] == stub.bodies[1], "the same rewritten request, twice"
    assert stub.bodies[0]["messages"][0]["content"][0]["type"] == "video_embeds"
    assert (_status(qwen3_server, "encoded"), _status(qwen3_server, "hit")) == (encoded + 1, hits + 1)
    assert 'encode_epd_proxy_retries_total{reason="prefill_error"} 1.0' in metrics
    assert "encode_epd_proxy_handoff_videos_total 2.0" in metrics
