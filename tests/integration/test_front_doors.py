"""HTTP and gRPC cannot drift: the same request through either door gives the same access-log
fields and the same request metrics (one code path, ``api/frontdoor.py``, accounts for both)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import b64, h, metric
from tests.images import image_bytes
from tests.server import ServerProcess, start_server

KEY = "doors-key-61c2"
COMPARED = ("method", "code", "items", "hits", "tenant")


@pytest.fixture(scope="module")
def server(server_logs: Path) -> Iterator[ServerProcess]:
    srv = start_server(
        "--tenant-isolation", "--log-format", "json", log_dir=server_logs,
        env={"ENCODE_SERVER_API_KEYS": f"acme:{KEY}"},
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def access_line(server: ServerProcess, request_id: str) -> dict[str, object]:
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("logger") == "encode_server.access" and line["request_id"] == request_id]
    assert len(mine) == 1, f"{len(mine)} access lines for {request_id}"
    return mine[0]


def via_http(server: ServerProcess, path: str, body: dict[str, object], request_id: str) -> int:
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-ID": request_id}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60).status_code


def via_grpc(call: Callable[..., object], request: object, request_id: str) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {KEY}"), ("x-request-id", request_id))
    try:
        call(request, metadata=metadata, timeout=60)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_the_same_requests_log_and_count_alike_through_either_door(server: ServerProcess) -> None:
    stub = pb_grpc.EncoderStub(grpc.insecure_channel(server.grpc_target))
    unknown = "ab" * 32
    fresh = {door: image_bytes("PNG", 30, 20, seed=seed) for door, seed in (("http", 701), ("grpc", 702))}
    cases = [  # (name, HTTP path and body, gRPC call and request) for each door's own image
        ("upload+miss", lambda d: ("/v1/encode", {"items": [{"data": b64(fresh[d])}, {"hash": unknown}]}),
         lambda d: (stub.Encode, pb.EncodeRequest(items=[pb.Item(data=fresh[d]), pb.Item(hash=unknown)]))),
        ("hash hit", lambda d: ("/v1/encode", {"items": [{"hash": h(fresh[d])}]}),
         lambda d: (stub.Encode, pb.EncodeRequest(items=[pb.Item(hash=h(fresh[d]))]))),
        ("lookup", lambda d: ("/v1/lookup", {"hashes": [h(fresh[d]), unknown]}),
         lambda d: (stub.Lookup, pb.LookupRequest(hashes=[h(fresh[d]), unknown]))),
        ("bad hash", lambda d: ("/v1/encode", {"items": [{"hash": "xyz"}]}),
         lambda d: (stub.Encode, pb.EncodeRequest(items=[pb.Item(hash="xyz")]))),
        ("sizes", lambda d: ("/v1/tokens", {"sizes": [[64, 48], [10, 10]]}),
         lambda d: (stub.Tokens, pb.TokensRequest(sizes=[pb.Size(width=64, height=48), pb.Size(width=10, height=10)]))),
    ]
    for name, http_case, grpc_case in cases:
        path, body = http_case("http")
        call, request = grpc_case("grpc")
        route = {"/v1/encode": "grpc:Encode", "/v1/lookup": "grpc:Lookup", "/v1/tokens": "grpc:Tokens"}[path]
        ids = {door: f"{door}-{name}".replace(" ", "-").replace("+", "-") for door in ("http", "grpc")}
        status = via_http(server, path, body, ids["http"])
        labels = f'{{code="{status}",route="{route}"}}'
        before = metric(server, "encode_server_requests_total", labels)
        via_grpc(call, request, ids["grpc"])
        after = metric(server, "encode_server_requests_total", labels)
        assert after == before + 1, f"{name}: the gRPC call was not counted as HTTP {status} on {route}"
        by_http, by_grpc = access_line(server, ids["http"]), access_line(server, ids["grpc"])
        assert set(by_http) == set(by_grpc), name
        assert {k: by_grpc[k] for k in COMPARED} == {k: by_http[k] for k in COMPARED}, name
        assert (by_http["protocol"], by_grpc["protocol"], by_grpc["route"]) == ("http", "grpc", route)
        assert int(by_http["bytes"]) > 0 and int(by_grpc["bytes"]) > 0, f"{name}: response bytes not counted"
    assert KEY not in server.log()
