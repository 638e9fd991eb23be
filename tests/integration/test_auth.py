"""API keys, tenant isolation and the access log, against a real server process."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from tests.images import image_bytes
from tests.server import ServerProcess, start_server

SOLO_KEY = "solo-key-0f3a9c"  # --api-key, no tenant
ACME_KEY = "acme-key-7d21e8"
GLOBEX_KEY = "globex-key-5b94c1"
ALL_KEYS = (SOLO_KEY, ACME_KEY, GLOBEX_KEY)


@pytest.fixture(scope="module")
def keyed_server(server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(
        "--api-key", SOLO_KEY, "--tenant-isolation", "--log-format", "json",
        log_dir=server_logs,
        env={"ENCODE_SERVER_API_KEYS": f"acme:{ACME_KEY}, globex:{GLOBEX_KEY}"},
    )
    yield server
    assert server.stop() == 0, server.log()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def encode(server: ServerProcess, items: list[dict], key: str | None, **headers: str) -> httpx.Response:
    headers = {**(bearer(key) if key else {}), **headers}
    return httpx.post(server.url + "/v1/encode", json={"items": items}, headers=headers, timeout=60)


def test_v1_routes_need_a_valid_key_and_probes_stay_open(keyed_server: ServerProcess) -> None:
    url = keyed_server.url
    for headers in ({}, bearer("wrong-key"), {"Authorization": SOLO_KEY}, {"Authorization": "Basic abc"}):
        for r in (
            httpx.post(url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]}, headers=headers),
            httpx.post(url + "/v1/lookup", json={"hashes": ["ab" * 32]}, headers=headers),
            httpx.post(url + "/v1/tokens", json={"sizes": [[64, 64]]}, headers=headers),
            httpx.get(url + "/v1/model", headers=headers),
        ):
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "unauthorized"
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert not any(k in r.text for k in ALL_KEYS)
    for key in ALL_KEYS:
        assert httpx.get(url + "/v1/model", headers=bearer(key)).status_code == 200
        assert encode(keyed_server, [{"hash": "ab" * 32}], key).status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    assert 'encode_server_rejected_total{reason="unauthorized"} 16.0' in httpx.get(url + "/metrics").text


def test_a_tenant_cannot_see_another_tenants_images(keyed_server: ServerProcess) -> None:
    data = image_bytes("PNG", 30, 30, seed=41)
    digest = blake3(data).hexdigest()
    sent = encode(keyed_server, [{"data": base64.b64encode(data).decode()}], ACME_KEY)
    assert sent.json()["items"][0]["status"] == "encoded"
    assert encode(keyed_server, [{"hash": digest}], ACME_KEY).json()["items"][0]["status"] == "hit"
    # globex and the tenant-less key (the default tenant) hold the same hash but not the image.
    for key in (GLOBEX_KEY, SOLO_KEY):
        assert encode(keyed_server, [{"hash": digest}], key).json()["items"][0]["status"] == "miss"
        r = httpx.post(keyed_server.url + "/v1/lookup", json={"hashes": [digest]}, headers=bearer(key))
        assert r.json()["items"] == [{"hash": digest, "cached": False, "tier": None}]
    r = httpx.post(keyed_server.url + "/v1/lookup", json={"hashes": [digest]}, headers=bearer(ACME_KEY))
    assert r.json()["items"] == [{"hash": digest, "cached": True, "tier": "local"}]
    # globex uploads the same bytes: its own encode, under its own key; same embedding.
    again = encode(keyed_server, [{"data": base64.b64encode(data).decode()}], GLOBEX_KEY).json()["items"][0]
    assert again["status"] == "encoded" and again["embedding"] == sent.json()["items"][0]["embedding"]


def test_one_json_access_line_per_request_with_its_id_and_no_key(keyed_server: ServerProcess) -> None:
    data = image_bytes("PNG", 20, 20, seed=42)
    r = encode(keyed_server, [{"data": base64.b64encode(data).decode()}, {"hash": "cd" * 32}], ACME_KEY,
               **{"X-Request-ID": "req-abc.123"})
    assert r.headers["X-Request-ID"] == "req-abc.123"
    assert encode(keyed_server, [{"hash": blake3(data).hexdigest()}], ACME_KEY).status_code == 200
    generated = httpx.get(keyed_server.url + "/v1/model", headers={**bearer(ACME_KEY), "X-Request-ID": "bad id; drop"})
    assert generated.headers["X-Request-ID"] != "bad id; drop" and len(generated.headers["X-Request-ID"]) == 32
    # The access line is written once the response has gone out: wait for it, don't race it.
    deadline = time.monotonic() + 10
    while generated.headers["X-Request-ID"] not in keyed_server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = keyed_server.log()
    assert not any(k in log for k in ALL_KEYS), "an API key reached the log"
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert lines, log
    access = [line for line in lines if line["logger"] == "encode_server.access"]
    mine = [line for line in access if line["request_id"] == "req-abc.123"]
    assert len(mine) == 1, access
    assert {k: mine[0][k] for k in ("method", "route", "code", "items", "hits", "tenant")} == {
        "method": "POST", "route": "/v1/encode", "code": 200, "items": 2, "hits": 0, "tenant": "acme"
    }
    assert mine[0]["duration_ms"] > 0
    assert any(line["route"] == "/v1/encode" and line["hits"] == 1 for line in access)
    assert any(line["request_id"] == generated.headers["X-Request-ID"] for line in access)
    assert all(line["logger"] != "uvicorn.access" for line in lines)


def test_grpc_calls_need_a_key_and_see_only_their_tenant(keyed_server: ServerProcess) -> None:
    import grpc

    from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
    from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc

    data = image_bytes("PNG", 26, 26, seed=43)
    digest = blake3(data).hexdigest()
    with grpc.insecure_channel(keyed_server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong-key"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Lookup(pb.LookupRequest(hashes=[digest]), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert dict(info.value.trailing_metadata())["error-type"] == "unauthorized"
            assert not any(k in (info.value.details() or "") for k in ALL_KEYS)
        acme = (("authorization", f"Bearer {ACME_KEY}"),)
        sent = stub.Encode(pb.EncodeRequest(items=[pb.Item(data=data)]), metadata=acme)
        assert sent.items[0].status == "encoded"
        assert stub.Lookup(pb.LookupRequest(hashes=[digest]), metadata=acme).items[0].cached
        globex = (("authorization", f"Bearer {GLOBEX_KEY}"),)
        assert not stub.Lookup(pb.LookupRequest(hashes=[digest]), metadata=globex).items[0].cached
        miss = stub.Encode(pb.EncodeRequest(items=[pb.Item(hash=digest)]), metadata=globex)
        assert miss.items[0].status == "miss"
    log = keyed_server.log()
    assert not any(k in log for k in (*ALL_KEYS, "wrong-key")), "a key reached the log"
