"""Clients that go away mid-request and mid-response (HTTP and gRPC), idle connections, and
requests for many large embeddings as JSON. Afterwards: pins, queue depth, requests in flight and
open connections back to zero; file descriptors and threads back to where they were; the server
still answers correctly. Loopback only, bounded in count and time."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import b64, h, metric, server_errors
from tests.images import image_bytes
from tests.robust.conftest import ROBUST_ARGS, open_fds, rss_kib, threads
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def quiescent(server: ServerProcess) -> dict[str, float]:
    names = ("inflight_requests", "queue_depth", "http_connections")
    out = {n: metric(server, f"encode_server_{n}") for n in names}
    out["pinned"] = metric(server, "encode_server_cache_pinned_bytes", '{tier="local"}')
    return out


def settled(server: ServerProcess) -> bool:
    q = quiescent(server)
    # The /metrics scrape itself is one request in flight and one connection.
    return q["inflight_requests"] <= 1 and q["queue_depth"] == 0 and q["pinned"] == 0 and q["http_connections"] <= 1


def raw_socket(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10)


def request_bytes(items: list[dict]) -> bytes:
    body = json.dumps({"items": items}).encode()
    return (b"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_disconnects_mid_request_and_mid_response_leak_nothing(robust_server: ServerProcess) -> None:
    pid = robust_server.proc.pid
    stub = pb_grpc.EncoderStub(grpc.insecure_channel(robust_server.grpc_target))
    warm = [image_bytes("PNG", 200, 200, seed=50_000 + i) for i in range(8)]
    assert httpx.post(robust_server.url + "/v1/encode", json={"items": [{"data": b64(d)} for d in warm]},
                      timeout=60).status_code == 200
    stub.Encode(pb.EncodeRequest(items=[pb.Item(data=warm[0])]), timeout=30)
    wait_for(lambda: settled(robust_server), 10, "not settled after the warm-up")
    fds, nthreads = open_fds(pid), threads(pid)

    for round_ in range(4):
        fresh = [image_bytes("PNG", 220, 180, seed=60_000 + 100 * round_ + i) for i in range(8)]
        whole = request_bytes([{"data": b64(d)} for d in fresh])
        # 1. Mid-body: half the body, then gone.
        s = raw_socket(robust_server)
        s.sendall(whole[: len(whole) // 2])
        s.close()
        # 2. Whole request (8 images to encode), gone before the answer.
        s = raw_socket(robust_server)
        s.sendall(whole)
        time.sleep(0.05)
        s.close()
        # 3. Mid-response: the (cached) answer starts, we read a little and close.
        s = raw_socket(robust_server)
        s.sendall(request_bytes([{"data": b64(d)} for d in warm]))
        assert s.recv(100).startswith(b"HTTP/1.1 ")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
        # 4. gRPC: cancelled while encoding, and a deadline that runs out.
        future = stub.Encode.future(pb.EncodeRequest(items=[pb.Item(data=d) for d in fresh[4:]]))
        time.sleep(0.05)
        future.cancel()
        with pytest.raises(grpc.RpcError) as info:
            # (an image that takes longer to encode than the deadline: a 300x300 PNG once did, and no
            # longer does on the built-in model, whose Qwen preprocessing got faster)
            stub.Encode(pb.EncodeRequest(items=[pb.Item(data=image_bytes("PNG", 900, 900, seed=70_000 + round_))]),
                        timeout=0.005)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    wait_for(lambda: settled(robust_server), 20, f"not back to quiescent: {quiescent(robust_server)}")
    wait_for(lambda: open_fds(pid) <= fds + 2, 10, f"fds {open_fds(pid)} vs {fds} before")
    assert threads(pid) <= nthreads + 2, (threads(pid), nthreads)
    # Still correct: what the dropped clients asked for, asked again, equals a fresh single request.
    again = image_bytes("PNG", 220, 180, seed=60_000 + 305)
    a = httpx.post(robust_server.url + "/v1/encode", json={"items": [{"data": b64(again)}]}, timeout=60).json()
    b = stub.Encode(pb.EncodeRequest(items=[pb.Item(hash=h(again))]), timeout=30)
    assert b.items[0].status == "hit"
    assert b64(b.items[0].embedding.data) == a["items"][0]["embedding"]
    assert server_errors(robust_server) == 0


def test_many_idle_connections_are_closed_and_others_served(robust_server: ServerProcess) -> None:
    """Idle after a response: --keep-alive-timeout; idle from the start: --header-timeout."""
    pid = robust_server.proc.pid
    fds = open_fds(pid)
    idle = []
    for i in range(60):
        s = raw_socket(robust_server)
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        idle.append(s)
    assert httpx.get(robust_server.url + "/v1/model", timeout=10).status_code == 200
    for s in idle:
        s.settimeout(8)
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        s.close()
    wait_for(lambda: open_fds(pid) <= fds + 2, 10, "idle connections still held")


def test_many_large_embeddings_as_json_have_bounded_memory(robust_logs) -> None:
    """32 items of the largest embedding the model makes, 8 requests at once, as JSON: the memory
    is bounded by --max-items x the largest embedding (x base64) per request in flight."""
    server = start_server(*ROBUST_ARGS, "--max-items", "64", "--max-request-bytes", str(64 << 20),
                          log_dir=robust_logs)
    try:
        images = [image_bytes("PNG", 448, 448, seed=80_000 + i) for i in range(32)]
        first = httpx.post(server.url + "/v1/encode", json={"items": [{"data": b64(d)} for d in images]},
                           timeout=300)
        assert first.status_code == 200, first.text
        size = len(first.content)
        assert size > 4 << 20  # 32 x 256 tokens x 128 dims x 4 bytes, in base64
        pid = server.proc.pid
        peak = rss_kib(pid, "VmHWM")
        body = {"items": [{"hash": h(d)} for d in images]}
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda _: httpx.post(server.url + "/v1/encode", json=body, timeout=120), range(16)))
        assert all(r.status_code == 200 and r.content == first.content.replace(b'"encoded"', b'"hit"')
                   .replace(b'"encoder"', b'"local"') for r in answers)
        growth_mib = (rss_kib(pid, "VmHWM") - peak) / 1024
        # 8 responses in flight of ~11 MiB each, plus their copies while rendering.
        assert growth_mib < 8 * size * 4 / 2**20, f"peak grew {growth_mib:.0f} MiB for {size >> 20} MiB answers"
        assert server_errors(server) == 0
    finally:
        assert server.stop() == 0, server.log()[-3000:]
