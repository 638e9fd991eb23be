"""Admission, timeouts and a cache too small for an item: clear answers, nothing lost or hung."""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from tests.images import bomb_png_header, image_bytes, slow_png
from tests.server import ServerProcess, start_server


@pytest.fixture(scope="module")
def tight_server(server_logs: Path) -> Iterator[ServerProcess]:
    # A queue of 2 and a 50 ms request timeout: an encode of slow_png (16 M pixels to decode and
    # resize) outlasts it, so its first requester times out; a hit does not.
    server = start_server(
        "--max-queue", "2",
        "--request-timeout", "0.05",
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
    data = slow_png(seed=7)
    started = time.monotonic()
    r = httpx.post(tight_server.url + "/v1/encode", json=_items(data), timeout=30)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout"
    assert time.monotonic() - started < 5
    # The encode went on behind the timed-out request and was cached: the retry is a hit, and
    # no queue slot or pin leaked.
    item = _wait_for_hit(tight_server, blake3(data).hexdigest())
    assert (item["status"], item["source"]) == ("hit", "local")
    assert "encode_server_queue_depth 0.0" in httpx.get(tight_server.url + "/metrics").text


def _wait_for_hit(server: ServerProcess, mm_hash: str, timeout: float = 10.0) -> dict:
    """Poll (bounded) until the abandoned encode of ``mm_hash`` has landed in the cache. A poll
    that joins the encode still in flight times out like its requester did (504): poll again."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": mm_hash}]}, timeout=30)
        assert r.status_code in (200, 504), r.text
        item = r.json()["items"][0] if r.status_code == 200 else {"status": "pending"}
        if item["status"] == "hit" or time.monotonic() > deadline:
            return item
        time.sleep(0.05)


def test_overloaded_and_timeout_have_their_grpc_twins(tight_server: ServerProcess) -> None:
    import grpc

    from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
    from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(tight_server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        three = [pb.Item(data=image_bytes("PNG", 20, 20, seed=200 + i)) for i in range(3)]
        with pytest.raises(grpc.RpcError) as overloaded:
            stub.Encode(pb.EncodeRequest(items=three), timeout=30)
        assert overloaded.value.code() == grpc.StatusCode.UNAVAILABLE
        md = dict(overloaded.value.trailing_metadata())
        assert md["error-type"] == "overloaded" and float(md["retry-after"]) >= 1
        data = slow_png(seed=201)
        with pytest.raises(grpc.RpcError) as late:
            stub.Encode(pb.EncodeRequest(items=[pb.Item(data=data)]), timeout=30)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert dict(late.value.trailing_metadata())["error-type"] == "timeout"
    assert _wait_for_hit(tight_server, blake3(data).hexdigest())["status"] == "hit"


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


def test_a_header_above_pillows_own_limit_is_refused_with_max_image_pixels(tight_server: ServerProcess) -> None:
    # 900 M pixels, five times what Pillow itself calls a "decompression bomb": our limit speaks.
    for route in ("/v1/encode", "/v1/tokens"):
        r = httpx.post(tight_server.url + route, json=_items(bomb_png_header(30000, 30000)), timeout=30)
        assert r.status_code == 413, (route, r.text)
        assert r.json()["error"] == {
            "type": "image_too_large", "index": 0,
            "message": "image is 30000x30000 = 900000000 pixels, above the limit of 40000000 (--max-image-pixels)",
        }


def test_a_1_mib_header_is_431_naming_the_flag_and_the_server_goes_on(tight_server: ServerProcess) -> None:
    """Before: 1, 8 and 50 MB headers were answered 200, and held in memory while parsed."""
    big = {"X-Big": "a" * (1 << 20)}
    r = httpx.get(tight_server.url + "/v1/model", headers=big, timeout=30)
    assert r.status_code == 431, r.text
    assert r.json()["error"] == {
        "type": "headers_too_large", "index": None,
        "message": "request headers are above the limit of 65536 bytes (--max-header-bytes)",
    }
    assert httpx.get(tight_server.url + "/v1/model", headers={"X-Big": "a" * 60_000}, timeout=30).status_code == 200
    metrics = httpx.get(tight_server.url + "/metrics").text
    assert 'encode_server_connections_closed_total{reason="headers_too_large"} 1.0' in metrics


def test_1_mib_of_grpc_metadata_is_refused_at_the_same_limit(tight_server: ServerProcess) -> None:
    import grpc

    from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
    from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(tight_server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Model(pb.ModelRequest(), metadata=[("x-big", "a" * (1 << 20))], timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        # Under the limit (grpc-core's own default is 8 KiB): answered.
        assert stub.Model(pb.ModelRequest(), metadata=[("x-big", "a" * 60_000)], timeout=30).fingerprint


def test_a_413_names_the_flag_that_sets_its_limit(tight_server: ServerProcess) -> None:
    too_many = {"items": [{"hash": f"{i:064x}"} for i in range(65)]}
    r = httpx.post(tight_server.url + "/v1/encode", json=too_many, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["message"] == "65 items in one request, above the limit of 64 (--max-items)"
    # A declared 1 GiB body, refused from its Content-Length before a byte of it is read.
    host, port = tight_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/encode HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1073741824\r\n\r\n")
        answer = b""
        while b"}}" not in answer and (chunk := conn.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["message"] == (
        "request body is 1073741824 bytes, above the limit of 67108864 (--max-request-bytes)"
    )
