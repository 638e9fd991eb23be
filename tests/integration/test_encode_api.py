"""/v1/encode and /v1/lookup against a real server process over real HTTP (built-in model)."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import httpx
import pytest

from encode_server.core.wire import load_safetensors
from tests.calls import b64, encode, h, metric, server_errors
from tests.images import bomb_png_header, image_bytes, truncated_jpeg
from tests.server import ServerProcess


def forwarded_images(server: ServerProcess) -> float:
    return metric(server, "encode_server_batch_size_sum")


def forward_calls(server: ServerProcess) -> float:
    return metric(server, "encode_server_batch_size_count")


def assert_serving(server: ServerProcess) -> None:
    data = image_bytes("PNG", 40, 40, seed=999)
    r = encode(server, [{"data": b64(data)}])
    assert r.status_code == 200, r.text
    assert r.json()["items"][0]["status"] in ("encoded", "hit")


def test_upload_then_hash_only_is_a_byte_identical_hit(builtin_server: ServerProcess) -> None:
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        data = image_bytes(fmt, 70, 50, seed=1)
        first = encode(builtin_server, [{"data": b64(data)}])
        assert first.status_code == 200, (fmt, first.text)
        item = first.json()["items"][0]
        assert (item["status"], item["source"], item["hash"]) == ("encoded", "encoder", h(data)), fmt
        again = encode(builtin_server, [{"hash": h(data)}]).json()["items"][0]
        assert (again["status"], again["source"]) == ("hit", "local")
        assert again["embedding"] == item["embedding"]
        assert again["shape"] == item["shape"] and again["shape"][0] == again["num_tokens"]
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == item["shape"][0] * item["shape"][1] * 4  # float32 on CPU
        assert item["meta"]["image_grid_thw"][0] == 1


def test_unknown_hash_is_a_200_miss(builtin_server: ServerProcess) -> None:
    r = encode(builtin_server, [{"hash": "ab" * 32}])
    assert r.status_code == 200
    assert r.json()["items"] == [{"index": 0, "hash": "ab" * 32, "status": "miss", "source": None}]


def test_mixed_items_keep_their_order(builtin_server: ServerProcess) -> None:
    known, new = image_bytes("PNG", 33, 44, seed=2), image_bytes("PNG", 44, 33, seed=3)
    assert encode(builtin_server, [{"data": b64(known)}]).status_code == 200
    unknown = "cd" * 32
    r = encode(builtin_server, [{"hash": unknown}, {"data": b64(new), "hash": h(new)}, {"hash": h(known)}])
    items = r.json()["items"]
    assert [i["index"] for i in items] == [0, 1, 2]
    assert [(i["hash"], i["status"]) for i in items] == [(unknown, "miss"), (h(new), "encoded"), (h(known), "hit")]


def test_duplicates_in_one_request_encode_once(builtin_server: ServerProcess) -> None:
    data = image_bytes("PNG", 50, 50, seed=4)
    before = forwarded_images(builtin_server)
    r = encode(builtin_server, [{"data": b64(data)}] * 3 + [{"hash": h(data)}])
    items = r.json()["items"]
    assert forwarded_images(builtin_server) - before == 1
    assert len({i["embedding"] for i in items}) == 1
    assert {i["status"] for i in items} == {"encoded"}


def test_concurrent_requests_for_one_new_image_run_one_encode(builtin_server: ServerProcess) -> None:
    data = image_bytes("PNG", 90, 60, seed=5)
    before = forwarded_images(builtin_server)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=builtin_server.url, timeout=60) as client:
            body = {"items": [{"data": b64(data)}]}
            return await asyncio.gather(*(client.post("/v1/encode", json=body) for _ in range(32)))

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    assert len({r.json()["items"][0]["embedding"] for r in responses}) == 1
    assert forwarded_images(builtin_server) - before == 1


def test_concurrent_single_image_requests_share_forward_passes(builtin_server: ServerProcess) -> None:
    images = [image_bytes("PNG", 32, 32, seed=1000 + i) for i in range(32)]
    calls_before, images_before = forward_calls(builtin_server), forwarded_images(builtin_server)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=builtin_server.url, timeout=60) as client:
            return await asyncio.gather(
                *(client.post("/v1/encode", json={"items": [{"data": b64(d)}]}) for d in images)
            )

    responses = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["items"][0]["status"] == "encoded" for r in responses)
    calls = forward_calls(builtin_server) - calls_before
    assert forwarded_images(builtin_server) - images_before == 32
    assert calls <= 16, f"32 concurrent requests ran {calls} forward passes"
    print(f"\n32 concurrent single-image requests -> {calls:.0f} forward calls")


def test_json_and_safetensors_responses_carry_the_same_bytes(builtin_server: ServerProcess) -> None:
    data = image_bytes("PNG", 80, 40, seed=6)
    as_json = encode(builtin_server, [{"data": b64(data)}, {"hash": "ef" * 32}]).json()
    r = httpx.post(
        builtin_server.url + "/v1/encode",
        json={"items": [{"hash": h(data)}, {"hash": "ef" * 32}]},
        headers={"Accept": "application/vnd.safetensors"},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
    tensors, metadata = load_safetensors(r.content)
    assert set(tensors) == {"0"}
    assert tensors["0"].data == base64.b64decode(as_json["items"][0]["embedding"])
    assert list(tensors["0"].shape) == as_json["items"][0]["shape"]
    meta_items = json.loads(metadata["items"])
    assert [(i["status"], i["hash"]) for i in meta_items] == [("hit", h(data)), ("miss", "ef" * 32)]
    assert metadata["fingerprint"] == as_json["fingerprint"]


def test_multipart_and_raw_bodies(builtin_server: ServerProcess) -> None:
    a, b = image_bytes("PNG", 36, 36, seed=7), image_bytes("JPEG", 36, 36, seed=8)
    r = httpx.post(builtin_server.url + "/v1/encode", files=[("file", ("a.png", a)), ("file", ("b.jpg", b))])
    assert r.status_code == 200, r.text
    assert [i["hash"] for i in r.json()["items"]] == [h(a), h(b)]
    raw = httpx.post(builtin_server.url + "/v1/encode", content=a, headers={"Content-Type": "image/png"})
    assert raw.status_code == 200
    assert raw.json()["items"][0]["status"] == "hit"
    octet = httpx.post(
        builtin_server.url + "/v1/encode", content=b, headers={"Content-Type": "application/octet-stream"}
    )
    assert octet.json()["items"][0]["embedding"] == r.json()["items"][1]["embedding"]


def test_data_url_is_accepted(builtin_server: ServerProcess) -> None:
    data = image_bytes("PNG", 30, 30, seed=9)
    r = encode(builtin_server, [{"data": "data:image/png;base64," + b64(data)}])
    assert r.status_code == 200 and r.json()["items"][0]["hash"] == h(data)


def test_lookup_reports_the_local_tier(builtin_server: ServerProcess) -> None:
    data = image_bytes("PNG", 31, 31, seed=10)
    encode(builtin_server, [{"data": b64(data)}])
    r = httpx.post(builtin_server.url + "/v1/lookup", json={"hashes": [h(data), "01" * 32]})
    assert r.json() == {
        "items": [
            {"hash": h(data), "cached": True, "tier": "local"},
            {"hash": "01" * 32, "cached": False, "tier": None},
        ]
    }
    bad = httpx.post(builtin_server.url + "/v1/lookup", json={"hashes": [h(data), "xyz"]})
    assert bad.status_code == 400 and bad.json()["error"] == {
        "type": "invalid_hash", "message": bad.json()["error"]["message"], "index": 1
    }


def test_metadata_return_without_a_shared_tier_is_409(builtin_server: ServerProcess) -> None:
    r = encode(builtin_server, [{"data": b64(image_bytes())}], **{"return": "metadata"})
    assert r.status_code == 409 and r.json()["error"]["type"] == "no_shared_tier"


GOOD = b64(image_bytes("PNG", 20, 20, seed=11))


def _post_json(items: list[dict]) -> dict:
    return {"content": json.dumps({"items": items}), "headers": {"Content-Type": "application/json"}}


BAD_INPUTS = [
    # (name, request kwargs, status, type, index)
    ("truncated jpeg", _post_json([{"data": b64(truncated_jpeg())}]), 400, "invalid_image", 0),
    ("random bytes", _post_json([{"data": b64(bytes(range(256)) * 4)}]), 400, "invalid_image", 0),
    ("empty json body", {"content": b"", "headers": {"Content-Type": "application/json"}}, 400, "invalid_json", None),
    ("empty raw body", {"content": b"", "headers": {"Content-Type": "image/png"}}, 400, "invalid_image", 0),
    ("invalid base64", _post_json([{"data": "not base64!!"}]), 400, "invalid_base64", 0),
    ("short hash", _post_json([{"hash": "abc123"}]), 400, "invalid_hash", 0),
    ("non-hex hash", _post_json([{"hash": "zz" * 32}]), 400, "invalid_hash", 0),
    ("hash mismatch", _post_json([{"data": GOOD, "hash": "00" * 32}]), 400, "hash_mismatch", 0),
    ("svg is not decodable", _post_json([{"data": b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>")}]),
     400, "invalid_image", 0),
    ("ico is unsupported", _post_json([{"data": b64(image_bytes("ICO", 32, 32))}]), 400, "unsupported_image", 0),
    ("decompression bomb", _post_json([{"data": b64(bomb_png_header())}]), 413, "image_too_large", 0),
    ("malformed json", {"content": b'{"items": [', "headers": {"Content-Type": "application/json"}},
     400, "invalid_json", None),
    ("schema mismatch", _post_json([{"dat": GOOD}]), 422, "invalid_request", 0),
    ("unsupported content type", {"content": b"hello", "headers": {"Content-Type": "text/plain"}},
     415, "unsupported_media_type", None),
    ("too many items", _post_json([{"hash": "ab" * 32}] * 9), 413, "too_many_items", None),
    ("over-size request", {"content": b"\x89PNG" + bytes(3 * 1024 * 1024), "headers": {"Content-Type": "image/png"}},
     413, "payload_too_large", None),
    ("one bad item among good ones",
     _post_json([{"data": GOOD}, {"hash": "ab" * 32}, {"data": b64(truncated_jpeg(1))}]), 400, "invalid_image", 2),
    ("bad hash among good ones", _post_json([{"data": GOOD}, {"hash": "nope"}]), 400, "invalid_hash", 1),
]


@pytest.mark.parametrize(("name", "kwargs", "status", "type_", "index"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_documented_4xx(
    builtin_server: ServerProcess, name: str, kwargs: dict, status: int, type_: str, index: int | None
) -> None:
    errors_before = server_errors(builtin_server)
    r = httpx.post(builtin_server.url + "/v1/encode", timeout=30, **kwargs)
    assert r.status_code == status, (name, r.text)
    body = r.json()
    assert set(body) == {"error"}
    assert body["error"]["type"] == type_, (name, body)
    assert body["error"]["index"] == index, (name, body)
    assert body["error"]["message"]
    assert_serving(builtin_server)
    assert server_errors(builtin_server) == errors_before, builtin_server.log()[-3000:]


def test_oversize_multipart_and_too_many_files(builtin_server: ServerProcess) -> None:
    small = image_bytes("PNG", 10, 10)
    r = httpx.post(builtin_server.url + "/v1/encode", files=[("f", ("x.png", small))] * 9)
    assert (r.status_code, r.json()["error"]["type"]) == (413, "too_many_items")
    big = httpx.post(builtin_server.url + "/v1/encode", files=[("f", ("x.png", bytes(3 * 1024 * 1024)))])
    assert (big.status_code, big.json()["error"]["type"]) == (413, "payload_too_large")
    assert_serving(builtin_server)


def test_model_health_ready_and_openapi(builtin_server: ServerProcess) -> None:
    model = httpx.get(builtin_server.url + "/v1/model").json()
    assert model["model"] == "builtin:tiny" and model["meaningless"] is True
    assert model["id"] == model["model"]  # the deprecated alias, kept for clients that read it
    assert re.fullmatch(r"[0-9a-f]{64}", model["fingerprint"])
    assert model["device"] == "cpu" and model["dtype"] == "float32"
    assert model["limits"]["max_items"] == 8 and model["batching"]["max_wait_ms"] == 50
    assert httpx.get(builtin_server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(builtin_server.url + "/ready").status_code == 200
    spec = httpx.get(builtin_server.url + "/openapi.json").json()
    responses = spec["paths"]["/v1/encode"]["post"]["responses"]
    assert {"200", "400", "409", "413", "415", "422", "503", "504"} <= set(responses)
    assert "meaningless" in builtin_server.log().lower()


def test_metrics_expose_the_basics(builtin_server: ServerProcess) -> None:
    text = httpx.get(builtin_server.url + "/metrics").text
    for name in (
        'encode_server_requests_total{code="200",route="/v1/encode"}',
        'encode_server_items_total{source="encoder",status="encoded"}',
        'encode_server_items_total{source="local",status="hit"}',
        'encode_server_cache_lookups_total{result="hit",tier="local"}',
        'encode_server_cache_bytes{tier="local"}',
        "encode_server_batch_size_bucket",
        "encode_server_forward_seconds_bucket",
        "encode_server_model_info{",
    ):
        assert name in text, name


def test_large_requests_and_responses_are_rendered_the_same(builtin_server: ServerProcess) -> None:
    """Above 256 KiB, base64 decoding and response rendering leave the event loop: same bytes."""
    images = [image_bytes("JPEG", 448, 448, seed=500 + i) for i in range(3)]
    singles = [encode(builtin_server, [{"data": b64(d)}]).json()["items"][0] for d in images]
    assert all(len(base64.b64decode(s["embedding"])) == 256 * 128 * 4 for s in singles)
    together = encode(builtin_server, [{"data": b64(d)} for d in images]).json()["items"]
    assert [t["embedding"] for t in together] == [s["embedding"] for s in singles]
    r = httpx.post(
        builtin_server.url + "/v1/encode",
        json={"items": [{"hash": h(d)} for d in images]},
        headers={"Accept": "application/vnd.safetensors"},
    )
    tensors, _ = load_safetensors(r.content)
    assert [tensors[str(i)].data for i in range(3)] == [base64.b64decode(s["embedding"]) for s in singles]
