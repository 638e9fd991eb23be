"""SIGTERM drains: /ready turns 503 and new work is refused, in-flight requests finish, exit 0."""

from __future__ import annotations

import base64
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.calls import metric
from tests.images import slow_png
from tests.server import start_server


def test_sigterm_finishes_in_flight_requests_then_exits_0(server_logs: Path) -> None:
    # Each image has 16 M pixels to decode and resize, so the requests below are still in flight
    # when all four are admitted and SIGTERM goes out.
    server = start_server("--drain-seconds", "20", log_dir=server_logs)
    try:
        images = [slow_png(seed=300 + i) for i in range(4)]
        results: list[httpx.Response] = []
        answered_at: list[float] = []

        def send(data: bytes) -> None:
            body = {"items": [{"data": base64.b64encode(data).decode()}]}
            results.append(httpx.post(server.url + "/v1/encode", json=body, timeout=30))
            answered_at.append(time.monotonic())

        threads = [threading.Thread(target=send, args=(d,)) for d in images]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while metric(server, "encode_server_queue_depth") < len(images):
            assert time.monotonic() < deadline, "requests never reached the queue"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()

        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503"
            time.sleep(0.02)
        refused = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "not_ready"
        assert int(refused.headers["Retry-After"]) >= 1

        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200] * len(images)
        assert min(answered_at) > signalled_at, "a request was answered before SIGTERM: none was in flight"
        assert all(r.json()["items"][0]["status"] == "encoded" for r in results)
        assert server.proc.wait(20) == 0, server.log()
        assert "drained; shutting down" in server.log()
    finally:
        server.stop()
