"""Admission, timeouts and a cache too small for an item: clear answers, nothing lost or hung."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from tests.images import image_bytes
from tests.server import ServerProcess, start_server


@pytest.fixture(scope="module")
def tight_server(server_logs: Path) -> Iterator[ServerProcess]:
    # A queue of 2. A batch waits 300 ms to fill, longer than the 100 ms request timeout, so
    # every encode times out its first requester.
    server = start_server(
        "--max-queue", "2",
        "--max-wait-ms", "300",
        "--request-timeout", "0.1",
        log_dir=server_logs,
    )
    yield server
    assert server.stop() == 0, server.log()


def _items(*images: bytes) -> dict:
    return {"items": [{"data": base64.b64encode(d).decode()} for d in images]}


def test_more_new_items_than_the_queue_holds_is_503_with_retry_after(tight_server: ServerProcess) -> None:
    images = [image_bytes("PNG", 20, 20, seed=100 + i) for i in range(3)]
    r = httpx.post(tight_server.url + "/v1/encode", json=_items(*images), timeout=30)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "overloaded"
    assert int(r.headers["Retry-After"]) >= 1
    assert 'encode_server_rejected_total{reason="overloaded"} 1.0' in httpx.get(tight_server.url + "/metrics").text


def test_timeout_is_504_and_the_work_is_not_lost(tight_server: ServerProcess) -> None:
    data = image_bytes("PNG", 24, 24, seed=7)
    started = time.monotonic()
    r = httpx.post(tight_server.url + "/v1/encode", json=_items(data), timeout=30)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout"
    assert time.monotonic() - started < 5
    # The encode went on behind the timed-out request and was cached: the retry is a hit, and
    # no queue slot or pin leaked.
    time.sleep(0.6)
    again = httpx.post(tight_server.url + "/v1/encode", json={"items": [{"hash": blake3(data).hexdigest()}]})
    assert (again.json()["items"][0]["status"], again.json()["items"][0]["source"]) == ("hit", "local")
    body = httpx.get(tight_server.url + "/metrics").text
    assert "encode_server_queue_depth 0.0" in body


def test_an_item_larger_than_the_cache_is_served_not_cached(server_logs: Path) -> None:
    server = start_server("--cache-mb", str(1 / 1024), log_dir=server_logs)
    try:
        data = image_bytes("PNG", 40, 40, seed=3)
        first = httpx.post(server.url + "/v1/encode", json=_items(data), timeout=30)
        assert first.status_code == 200 and first.json()["items"][0]["status"] == "encoded"
        assert len(base64.b64decode(first.json()["items"][0]["embedding"])) > 1024
        again = httpx.post(
            server.url + "/v1/encode", json={"items": [{"hash": blake3(data).hexdigest()}]}, timeout=30
        )
        assert again.json()["items"][0]["status"] == "miss"
        second = httpx.post(server.url + "/v1/encode", json=_items(data), timeout=30)
        assert second.json()["items"][0]["embedding"] == first.json()["items"][0]["embedding"]
        assert 'encode_server_cache_bytes{tier="local"} 0.0' in httpx.get(server.url + "/metrics").text
    finally:
        assert server.stop() == 0, server.log()
