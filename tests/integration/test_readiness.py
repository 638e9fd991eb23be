"""/ready is 503 while the model loads and warms up, then 200; /health answers all along.

The server runs in-process (uvicorn on a real loopback port, real HTTP) so that the test can hold
the model load open: the loader is the real ``load_encoder``, gated by an event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from encode_server.api.http import create_app
from encode_server.api.runtime import Runtime
from encode_server.config import Settings
from encode_server.encoders import load_encoder
from encode_server.encoders.base import VisionEncoder
from encode_server.metrics import Metrics
from tests.server import free_port


@pytest.fixture
def gated_server() -> Iterator[tuple[str, threading.Event]]:
    gate = threading.Event()

    def slow_load() -> VisionEncoder:
        assert gate.wait(30), "the test never opened the gate"
        return load_encoder("builtin:tiny", device="cpu")

    port = free_port()
    settings = Settings(port=port, grpc_port=0)
    app = create_app(Runtime(settings, Metrics()), slow_load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url, gate
    finally:
        gate.set()
        server.should_exit = True
        thread.join(20)


def test_ready_is_503_while_loading_then_200(gated_server: tuple[str, threading.Event]) -> None:
    url, gate = gated_server
    assert httpx.get(url + "/health").status_code == 200
    loading = httpx.get(url + "/ready")
    assert loading.status_code == 503 and loading.json()["error"]["type"] == "not_ready"
    assert int(loading.headers["Retry-After"]) >= 1
    early = httpx.post(url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]})
    assert (early.status_code, early.json()["error"]["type"]) == (503, "not_ready")
    gate.set()
    deadline = time.monotonic() + 30
    while httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(0.05)
    assert httpx.post(url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]}).status_code == 200
