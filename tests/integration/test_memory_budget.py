"""One budget for request bytes in flight (--max-inflight-mb), tried the way a burst of large
uploads, or a hostile client, would try it: over real HTTP and gRPC against a real server whose
resident memory is read from /proc while it runs.

The server here has a small budget (160 MiB, uploads up to 32 MiB) so that a burst several times
the budget stays cheap on a small machine; ``bench/memory_burst.py`` runs the full 64 x 60 MiB
burst against the default limits and prints the figures docs/robustness.md quotes.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import b64, metric
from tests.images import image_bytes
from tests.server import ServerProcess, start_server
from tests.uploads import (
    MIB,
    Payload,
    RssSampler,
    Upload,
    chunked,
    mixed_payloads,
    noise_png,
    random_bytes,
    read_response,
    rss_bytes,
    upload,
)

BUDGET = 160 * MIB
MAX_REQUEST = 32 * MIB
SIZE = 24 * MIB
BURST = 32
# What the process may hold beyond the budget at its peak: what no request owns alone (uvicorn's
# and the kernel's read buffers, thread stacks and arenas, allocator slack) and the frames of an
# error response's traceback between its hold's release and their own. Measured at 40-70 MiB.
MARGIN = 96 * MIB
# A refusal of a declared body answers at once; generous for a busy 2-core machine.
QUICK_S = 5.0


@pytest.fixture(scope="module")
def server(server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        "--max-inflight-mb", str(BUDGET // MIB),
        "--max-request-bytes", str(MAX_REQUEST),
        "--cache-mb", "16",
        log_dir=server_logs,
    )
    yield server
    assert server.stop() == 0, server.log()


def port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def payloads() -> list[Payload]:
    return mixed_payloads(SIZE)


def inflight(server: ServerProcess) -> float:
    return metric(server, "encode_server_inflight_bytes")


def memory_refusals(server: ServerProcess) -> float:
    return metric(server, "encode_server_rejected_total", '{reason="memory"}')


def wait_for(predicate: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"not true after {timeout} s")


@contextmanager
def pinned(server: ServerProcess, count: int, declared: int = 30 * MIB) -> Iterator[None]:
    """``count`` clients that declare ``declared`` bytes and send one: the budget holds all of it."""
    before = inflight(server)
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port_of(server)), timeout=30)
            sock.sendall(
                f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {declared}\r\n\r\n".encode() + b"\x89"
            )
            socks.append(sock)
        wait_for(lambda: inflight(server) >= before + count * declared)
        yield
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: inflight(server) == before)


def small_encode(server: ServerProcess, seed: int) -> httpx.Response:
    return httpx.post(server.url + "/v1/encode", json={"items": [{"data": b64(image_bytes(seed=seed))}]}, timeout=60)


def error_type(body: bytes) -> str:
    return str(json.loads(body)["error"]["type"])


def test_a_declared_body_that_does_not_fit_is_refused_before_a_byte_of_it_is_sent(server: ServerProcess) -> None:
    refusals = memory_refusals(server)
    with pinned(server, 5):  # 150 of 160 MiB held
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as sock:
            sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                         + f"Content-Length: {SIZE}\r\n\r\n".encode())
            answer = read_response(sock, Upload())  # the head only: not one byte of the body was sent
        elapsed = time.monotonic() - started
        assert answer.status == 503 and answer.headers.get("retry-after") == "1", answer
        assert error_type(answer.body) == "overloaded" and "memory budget" in answer.body.decode()
        assert elapsed < QUICK_S
        assert memory_refusals(server) == refusals + 1
        # A small request still fits in what is left, and is served.
        assert small_encode(server, seed=11).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
    assert inflight(server) == 0


def test_a_chunked_body_is_cut_off_at_the_budget_and_its_connection_closed(server: ServerProcess) -> None:
    with pinned(server, 5):  # 10 MiB left
        r = upload(port_of(server), "/v1/encode", chunked(None), timeout=60)
        assert r.status == 503 and error_type(r.body) == "overloaded", r
        assert r.headers.get("connection") == "close" and r.headers.get("retry-after") == "1"
        # What was taken: at most the 10 MiB left, plus what sits in the two sockets' buffers.
        assert r.sent <= 10 * MIB + 16 * MIB, r.sent
    # Unpinned, a body that never ends is cut at --max-request-bytes instead (413), also closed.
    r = upload(port_of(server), "/v1/encode", chunked(None), timeout=60)
    assert r.status == 413 and r.headers.get("connection") == "close", r
    assert r.sent <= MAX_REQUEST + 16 * MIB
    wait_for(lambda: inflight(server) == 0)
    assert small_encode(server, seed=12).status_code == 200


def test_bytes_beyond_a_declared_content_length_are_never_taken(server: ServerProcess) -> None:
    base = rss_bytes(server.proc.pid)
    extra = b"\0" * (48 * MIB)
    with RssSampler(server.proc.pid) as rss:
        r = upload(port_of(server), "/v1/encode", b"\x89PNG" + b"\0" * 996, extra=extra, stop_on_answer=False)
    # The 1000 declared bytes are the body; what follows is parsed as the next request, refused
    # as no HTTP at all (400, often before the first answer is written), and the connection closes.
    assert r.status == 400, r
    assert r.sent < len(extra), "the server kept reading past the declared length"
    assert rss.peak - base < 32 * MIB
    wait_for(lambda: inflight(server) == 0)
    assert small_encode(server, seed=13).status_code == 200


def test_a_burst_of_large_uploads_stays_within_the_budget_and_others_are_served(
    server: ServerProcess, payloads: list[Payload]
) -> None:
    pid = server.proc.pid
    idle = rss_bytes(pid)
    refusals = memory_refusals(server)
    errors = metric(server, "encode_server_requests_total", '{code="500",route="/v1/encode"}')
    stop = threading.Event()
    side: list[tuple[str, int, str | None]] = []

    def small_requests() -> None:
        seed = 100
        while not stop.is_set():
            seed += 1
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            r = small_encode(server, seed)
            side.append(("encode", r.status_code, r.json()["error"]["type"] if r.status_code != 200 else None))
            time.sleep(0.02)

    watcher = threading.Thread(target=small_requests)
    with RssSampler(pid) as rss:
        watcher.start()
        with ThreadPoolExecutor(BURST) as pool:
            futures = [
                pool.submit(upload, port_of(server), "/v1/encode", p.body, content_type=p.content_type)
                for p in (payloads[i % len(payloads)] for i in range(BURST))
            ]
            results = [f.result() for f in futures]
        stop.set()
        watcher.join()

    kinds = Counter((r.status, error_type(r.body) if r.status != 200 else None) for r in results)
    refused = [r for r in results if r.status == 503]
    print(f"\nburst: {kinds}; idle {idle / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB "
          f"(+{(rss.peak - idle) / MIB:.0f}), budget {BUDGET / MIB:.0f} MiB; slowest refusal "
          f"{max((r.seconds for r in refused), default=0):.2f} s")
    # Every answer is one the contract allows: served (200), bad bytes (400), or refused (503).
    assert set(kinds) <= {(200, None), (400, "invalid_image"), (503, "overloaded")}, kinds
    assert refused and len(refused) < BURST, "the burst must be more than the budget, not everything"
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert all(r.seconds < 30 for r in refused)
    assert memory_refusals(server) >= refusals + len(refused)
    # The peak: the budget plus the stated margin over the idle footprint.
    assert rss.peak - idle <= BUDGET + MARGIN, (rss.peak - idle) / MIB
    # Small requests kept being served (a small one may meet a full budget too: then 503).
    assert side and {s for s in side} <= {("encode", 200, None), ("encode", 503, "overloaded")}
    assert ("encode", 200, None) in side
    # Afterwards: nothing is held, and memory falls back near where it was.
    wait_for(lambda: inflight(server) == 0)
    wait_for(lambda: rss_bytes(pid) - idle < 64 * MIB, timeout=30)
    assert metric(server, "encode_server_requests_total", '{code="500",route="/v1/encode"}') == errors


def test_grpc_calls_reserve_a_largest_message_before_it_is_received(
    server: ServerProcess, payloads: list[Payload]
) -> None:
    pid = server.proc.pid
    idle = rss_bytes(pid)
    datas = [random_bytes(SIZE, seed=5), noise_png(SIZE, seed=6)]
    options = [("grpc.max_send_message_length", -1)]
    channels = [grpc.insecure_channel(server.grpc_target, options=options) for _ in range(4)]
    try:
        stubs = [pb_grpc.EncoderStub(c) for c in channels]

        def call(i: int) -> tuple[str, str | None, str | None, float]:
            started = time.monotonic()
            try:
                stubs[i % len(stubs)].Encode(pb.EncodeRequest(items=[pb.Item(data=datas[i % 2])]), timeout=60)
                return "OK", None, None, time.monotonic() - started
            except grpc.RpcError as err:
                md = dict(err.trailing_metadata() or ())
                return err.code().name, md.get("error-type"), md.get("retry-after"), time.monotonic() - started

        with RssSampler(pid) as rss, ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(call, range(16)))
    finally:
        for c in channels:
            c.close()
    kinds = Counter(o[:3] for o in outcomes)
    print(f"\ngRPC burst: {kinds}; idle {idle / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB")
    assert set(kinds) <= {("OK", None, None), ("INVALID_ARGUMENT", "invalid_image", None),
                          ("UNAVAILABLE", "overloaded", "1")}, kinds
    assert any(o[0] == "UNAVAILABLE" for o in outcomes) and any(o[0] != "UNAVAILABLE" for o in outcomes)
    assert rss.peak - idle <= BUDGET + MARGIN, (rss.peak - idle) / MIB
    wait_for(lambda: inflight(server) == 0)
    # And a small gRPC call goes through once the burst is over.
    ok = pb_grpc.EncoderStub(grpc.insecure_channel(server.grpc_target)).Encode(
        pb.EncodeRequest(items=[pb.Item(data=image_bytes(seed=21))]), timeout=60
    )
    assert ok.items[0].status in ("encoded", "hit")


def test_grpc_refuses_an_upload_at_once_when_full_but_still_answers_lookups(server: ServerProcess) -> None:
    channel = grpc.insecure_channel(server.grpc_target, options=[("grpc.max_send_message_length", -1)])
    stub = pb_grpc.EncoderStub(channel)
    refusals = memory_refusals(server)
    with pinned(server, 5):  # 150 of 160 MiB held: no room to receive a largest message
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Encode(pb.EncodeRequest(items=[pb.Item(data=random_bytes(SIZE, seed=9))]), timeout=60)
        elapsed = time.monotonic() - started
        md = dict(info.value.trailing_metadata() or ())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert (md.get("error-type"), md.get("retry-after")) == ("overloaded", "1")
        assert info.value.details().startswith("overloaded: ")
        assert elapsed < QUICK_S
        assert memory_refusals(server) == refusals + 1
        # Lookups carry hashes only: they reserve a light message, and are answered.
        found = stub.Lookup(pb.LookupRequest(hashes=["0" * 64]), timeout=30)
        assert [item.cached for item in found.items] == [False]
    assert metric(server, "encode_server_requests_total", '{code="503",route="grpc:Encode"}') >= 1
