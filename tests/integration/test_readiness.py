"""/ready is 503 while the model loads and warms up, then 200; /health answers all along.

The server runs in-process (the composition root, ``EncodeServer``, on a real loopback port, real
HTTP) so that the test can hold the model load open: the loader is the real ``load_encoder``,
gated by an event.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from encode_server.app import EncodeServer
from encode_server.config import Settings
from encode_server.encoders import load_encoder
from encode_server.encoders.base import Encoder
from tests.server import free_port


@pytest.fixture
def gated_server() -> Iterator[tuple[str, threading.Event]]:
    gate = threading.Event()

    def slow_load() -> Encoder:
        assert gate.wait(30), "the test never opened the gate"
        return load_encoder("builtin:tiny", device="cpu")

    port = free_port()
    # The quick warm-up: the worst case's (tests/integration/test_warmup.py) took 17-30 s here under a
    # loaded make test, and what is tested is the 503 until the model is loaded and warm, not its length.
    settings = Settings(port=port, grpc_port=0, log_level="warning", drain_seconds=5, warmup="quick")
    server = EncodeServer(settings, load_encoder=slow_load)
    exit_codes: list[int] = []
    thread = threading.Thread(target=lambda: exit_codes.append(asyncio.run(server.serve())), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.http.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url, gate
    finally:
        gate.set()
        server.shutdown()
        thread.join(20)
    assert exit_codes == [0], "the server did not drain and exit cleanly"


def test_ready_is_503_while_loading_then_200(gated_server: tuple[str, threading.Event]) -> None:
    url, gate = gated_server
    assert httpx.get(url + "/health").status_code == 200
    loading = httpx.get(url + "/ready")
    assert loading.status_code == 503 and loading.json()["error"]["type"] == "not_ready"
    assert int(loading.headers["Retry-After"]) >= 1
    early = httpx.post(url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]})
    assert (early.status_code, early.json()["error"]["type"]) == (503, "not_ready")
    gate.set()
    deadline = time.monotonic() + 60
    while httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "never became ready"
        time.sleep(0.05)
    assert httpx.post(url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]}).status_code == 200
