"""Hostile connections: headers that never finish, bodies that stall, idle sockets, too many
sockets. The server answers 408 / 503 (JSON), frees each connection after the documented timeout,
and serves everyone else meanwhile. Loopback only, bounded in count and time."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from tests.calls import b64, metric
from tests.images import image_bytes
from tests.robust.conftest import open_fds
from tests.server import ServerProcess

pytestmark = pytest.mark.integration

HEADER_TIMEOUT = BODY_TIMEOUT = 2.0  # conftest.ROBUST_ARGS
SLACK = 4.0


def connect(server: ServerProcess) -> socket.socket:
    port = int(server.url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; and when that was."""
    started = time.monotonic()
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {timeout} s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


def status_and_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]["type"]


def test_stalled_headers_and_bodies_are_cut_while_others_are_served(robust_server: ServerProcess) -> None:
    baseline_fds = open_fds(robust_server.proc.pid)
    before = {r: metric(robust_server, "encode_server_connections_closed_total", f'{{reason="{r}"}}')
              for r in ("header_timeout", "body_timeout")}
    silent = [connect(robust_server) for _ in range(20)]  # connect, send nothing
    partial = [connect(robust_server) for _ in range(20)]  # headers that never finish
    for s in partial:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    stalled = [connect(robust_server) for _ in range(20)]  # a declared body that stops
    for s in stalled:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{\"items\": [")
    # Everyone else is served meanwhile, with the same answers as always.
    data = image_bytes("PNG", 40, 40, seed=9001)
    r = httpx.post(robust_server.url + "/v1/encode", json={"items": [{"data": b64(data)}]}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(robust_server.url + "/health").status_code == 200

    for group, kind in ((silent, "header"), (partial, "header"), (stalled, "body")):
        for s in group:
            raw, _ = read_until_closed(s, HEADER_TIMEOUT + SLACK)
            status, error = status_and_error(raw)
            assert (status, error) == (408, "request_timeout"), (kind, raw[:300])
            assert (b"--header-timeout" if kind == "header" else b"--body-timeout") in raw
            s.close()
    after = {r: metric(robust_server, "encode_server_connections_closed_total", f'{{reason="{r}"}}')
             for r in before}
    assert after["header_timeout"] - before["header_timeout"] >= 40
    assert after["body_timeout"] - before["body_timeout"] >= 20
    deadline = time.monotonic() + 10
    while open_fds(robust_server.proc.pid) > baseline_fds + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds(robust_server.proc.pid) <= baseline_fds + 2
    assert metric(robust_server, "encode_server_http_connections") <= 2  # the scrape itself (+ a keep-alive)
    assert metric(robust_server, "encode_server_inflight_requests") <= 1


def test_a_slow_but_moving_body_is_not_cut(robust_server: ServerProcess) -> None:
    """The body timeout is an idle timeout: a byte every second is progress, for 3x its length."""
    body = json.dumps({"hashes": ["0" * 64]}).encode()
    s = connect(robust_server)
    s.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    steps = 6
    size = -(-len(body) // steps)
    for i in range(steps):
        time.sleep(BODY_TIMEOUT / 2)
        s.sendall(body[i * size : (i + 1) * size])
    raw, _ = read_until_closed(s, 10)
    s.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b'"cached":false' in raw.replace(b" ", b"")


def test_keep_alive_then_half_a_request_is_cut_too(robust_server: ServerProcess) -> None:
    """After a full request on a kept-alive connection, the next request's header clock runs."""
    s = connect(robust_server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 12")
    raw, took = read_until_closed(s, HEADER_TIMEOUT + SLACK)
    s.close()
    assert status_and_error(raw) == (408, "request_timeout")
    assert took <= HEADER_TIMEOUT + SLACK


def test_connections_past_the_cap_get_503_and_the_server_recovers(robust_server: ServerProcess) -> None:
    cap = 96  # conftest.ROBUST_ARGS --max-connections
    held = [connect(robust_server) for _ in range(cap)]
    time.sleep(0.3)  # let the server accept them all
    extra = [connect(robust_server) for _ in range(8)]
    refused = 0
    for s in extra:
        raw, _ = read_until_closed(s, 5)
        s.close()
        assert re.match(rb"HTTP/1.1 503 ", raw), raw[:200]
        assert status_and_error(raw) == (503, "overloaded")
        assert b"retry-after: 1" in raw.lower()
        refused += 1
    assert refused == 8
    for s in held:
        s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(robust_server.url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "not serving after the held connections closed"
        time.sleep(0.1)
    assert metric(robust_server, "encode_server_connections_closed_total", '{reason="max_connections"}') >= 8
