"""gRPC and /v1/tokens against the real built-in server (module fixture from conftest):
health, the same results as HTTP, and every applicable HTTP error case with its gRPC twin."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.images import bomb_png_header, image_bytes, truncated_jpeg
from tests.integration.test_encode_api import GOOD
from tests.server import ServerProcess, start_server
from tests.tiny_models import make_clip


@pytest.fixture(scope="module")
def stub(builtin_server: ServerProcess) -> pb_grpc.EncoderStub:
    return pb_grpc.EncoderStub(grpc.insecure_channel(builtin_server.grpc_target))


def test_health_is_serving_once_ready(builtin_server: ServerProcess) -> None:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(builtin_server.grpc_target))
    for service in ("", "encode_server.v1.Encoder"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_encode_equals_http(builtin_server: ServerProcess, stub: pb_grpc.EncoderStub) -> None:
    data = image_bytes("PNG", 77, 41, seed=501)
    got = stub.Encode(pb.EncodeRequest(items=[pb.Item(data=data), pb.Item(hash="ab" * 32)]), timeout=30)
    item = got.items[0]
    http = httpx.post(builtin_server.url + "/v1/encode", json={"items": [{"hash": item.hash}]}).json()["items"][0]
    assert (item.status, item.source, http["status"]) == ("encoded", "encoder", "hit")
    assert item.embedding.data == base64.b64decode(http["embedding"])
    assert list(item.embedding.shape) == http["shape"] and item.embedding.dtype == http["dtype"]
    assert json.loads(item.meta_json) == http["meta"] and item.num_tokens == http["num_tokens"]
    assert (got.items[1].status, got.items[1].HasField("source")) == ("miss", False)
    found = stub.Lookup(pb.LookupRequest(hashes=[item.hash, "01" * 32]), timeout=5).items
    assert [(f.cached, f.tier if f.HasField("tier") else None) for f in found] == [(True, "local"), (False, None)]
    model = stub.Model(pb.ModelRequest(), timeout=5)
    assert json.loads(model.json)["fingerprint"] == model.fingerprint == got.fingerprint
    assert model.model == model.id == json.loads(model.json)["model"] == got.model  # id: the deprecated alias


def _rpc_error(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)  # type: ignore[operator]
    return info.value


def _twin(items: list[pb.Item]) -> pb.EncodeRequest:
    return pb.EncodeRequest(items=items)


GOOD_BYTES = base64.b64decode(GOOD)
# The BAD_INPUTS of test_encode_api that exist in gRPC (no JSON, base64 or content types there).
GRPC_TWINS = [
    ("truncated jpeg", _twin([pb.Item(data=truncated_jpeg())]), "INVALID_ARGUMENT", "invalid_image", 0),
    ("random bytes", _twin([pb.Item(data=bytes(range(256)) * 4)]), "INVALID_ARGUMENT", "invalid_image", 0),
    ("empty raw body", _twin([pb.Item(data=b"")]), "INVALID_ARGUMENT", "invalid_image", 0),
    ("short hash", _twin([pb.Item(hash="abc123")]), "INVALID_ARGUMENT", "invalid_hash", 0),
    ("non-hex hash", _twin([pb.Item(hash="zz" * 32)]), "INVALID_ARGUMENT", "invalid_hash", 0),
    ("hash mismatch", _twin([pb.Item(data=GOOD_BYTES, hash="00" * 32)]), "INVALID_ARGUMENT", "hash_mismatch", 0),
    ("svg is not decodable", _twin([pb.Item(data=b"<svg xmlns='http://www.w3.org/2000/svg'/>")]),
     "INVALID_ARGUMENT", "invalid_image", 0),
    ("ico is unsupported", _twin([pb.Item(data=image_bytes("ICO", 32, 32))]), "INVALID_ARGUMENT",
     "unsupported_image", 0),
    ("decompression bomb", _twin([pb.Item(data=bomb_png_header())]), "RESOURCE_EXHAUSTED", "image_too_large", 0),
    ("schema mismatch", _twin([pb.Item()]), "INVALID_ARGUMENT", "invalid_request", 0),
    ("no items", _twin([]), "INVALID_ARGUMENT", "invalid_request", None),
    ("too many items", _twin([pb.Item(hash="ab" * 32)] * 9), "RESOURCE_EXHAUSTED", "too_many_items", None),
    ("over-size request", _twin([pb.Item(data=b"\x89PNG" + bytes(2 * 1024 * 1024))]), "RESOURCE_EXHAUSTED",
     "payload_too_large", None),
    ("one bad item among good ones",
     _twin([pb.Item(data=GOOD_BYTES), pb.Item(hash="ab" * 32), pb.Item(data=truncated_jpeg(1))]),
     "INVALID_ARGUMENT", "invalid_image", 2),
    ("bad hash among good ones", _twin([pb.Item(data=GOOD_BYTES), pb.Item(hash="nope")]),
     "INVALID_ARGUMENT", "invalid_hash", 1),
    ("metadata without a shared tier",
     pb.EncodeRequest(items=[pb.Item(data=GOOD_BYTES)], return_kind=pb.RETURN_METADATA),
     "FAILED_PRECONDITION", "no_shared_tier", None),
]


@pytest.mark.parametrize(("name", "request_", "code", "type_", "index"), GRPC_TWINS, ids=[t[0] for t in GRPC_TWINS])
def test_bad_input_gets_the_same_error_type_over_grpc(
    stub: pb_grpc.EncoderStub, name: str, request_: pb.EncodeRequest, code: str, type_: str, index: int | None
) -> None:
    err = _rpc_error(stub.Encode, request_)
    md = dict(err.trailing_metadata() or ())
    assert (err.code().name, md.get("error-type")) == (code, type_), (name, err.details())
    assert md.get("error-index") == (None if index is None else str(index)), name
    assert err.details().startswith(f"{type_}: ")
    assert stub.Encode(_twin([pb.Item(data=GOOD_BYTES)]), timeout=30).items[0].status in ("hit", "encoded")


def test_lookup_and_tokens_errors_over_grpc(stub: pb_grpc.EncoderStub) -> None:
    err = _rpc_error(stub.Lookup, pb.LookupRequest(hashes=["ab" * 32, "xyz"]))
    assert dict(err.trailing_metadata())["error-type"] == "invalid_hash"
    assert dict(err.trailing_metadata())["error-index"] == "1"
    err = _rpc_error(stub.Tokens, pb.TokensRequest(sizes=[pb.Size(width=0, height=5)]))
    assert (err.code(), dict(err.trailing_metadata())["error-type"]) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                        "invalid_request")


def _exif_jpeg(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buf, "JPEG", exif=exif)
    return buf.getvalue()


SIZES = [(28, 28), (56, 56), (100, 60), (224, 224), (300, 120), (57, 333), (640, 480), (1000, 37), (333, 777)]


def test_tokens_equal_what_encode_returns(builtin_server: ServerProcess, stub: pb_grpc.EncoderStub) -> None:
    """Many sizes, PNG and EXIF-rotated JPEG (orientations 6 and 8 swap width and height)."""
    images = [image_bytes("PNG", w, h, seed=w + h) for w, h in SIZES]
    images += [_exif_jpeg(300, 120, 6), _exif_jpeg(57, 200, 8), _exif_jpeg(90, 40, 3)]
    for data in images:
        body = {"items": [{"data": base64.b64encode(data).decode()}]}
        encoded = httpx.post(builtin_server.url + "/v1/encode", json=body, timeout=60).json()["items"][0]
        by_upload = httpx.post(builtin_server.url + "/v1/tokens", content=data,
                               headers={"Content-Type": "image/png"}).json()["items"][0]
        assert (by_upload["num_tokens"], by_upload["meta"]) == (encoded["num_tokens"], encoded["meta"])
        by_size = httpx.post(builtin_server.url + "/v1/tokens",
                             json={"sizes": [[by_upload["width"], by_upload["height"]]]}).json()["items"][0]
        assert by_size["num_tokens"] == encoded["num_tokens"]
        over_grpc = stub.Tokens(pb.TokensRequest(items=[pb.Item(data=data)]), timeout=30).items[0]
        assert (over_grpc.num_tokens, json.loads(over_grpc.meta_json)) == (encoded["num_tokens"], encoded["meta"])
    rotated = httpx.post(builtin_server.url + "/v1/tokens", content=images[-3],
                         headers={"Content-Type": "image/jpeg"}).json()["items"][0]
    assert (rotated["width"], rotated["height"]) == (120, 300)


def test_tokens_errors_and_openapi(builtin_server: ServerProcess) -> None:
    cases = [
        ({"sizes": [[1, 0]]}, 422, "invalid_request", 0),
        ({"sizes": [[3, 4], [1, 2, 3]]}, 422, "invalid_request", 1),
        ({"items": [{"hash": "ab" * 32}]}, 422, "invalid_request", 0),
        ({"sizes": [[5, 5]], "items": [{"data": GOOD}]}, 422, "invalid_request", None),
        ({"sizes": [[100000, 100000]]}, 413, "image_too_large", 0),
        ({"items": [{"data": base64.b64encode(truncated_jpeg()).decode()[:40]}]}, 400, "invalid_image", 0),
    ]
    for body, status, type_, index in cases:
        r = httpx.post(builtin_server.url + "/v1/tokens", json=body)
        assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["index"]) == (status, type_, index), body
    # The same cases over gRPC (a size with a third member has no protobuf twin).
    twins = [
        (pb.TokensRequest(sizes=[pb.Size(width=1, height=0)]), "invalid_request", 0),
        (pb.TokensRequest(items=[pb.Item(hash="ab" * 32)]), "invalid_request", 0),
        (pb.TokensRequest(sizes=[pb.Size(width=5, height=5)], items=[pb.Item(data=GOOD_BYTES)]),
         "invalid_request", None),
        (pb.TokensRequest(sizes=[pb.Size(width=100000, height=100000)]), "image_too_large", 0),
        (pb.TokensRequest(items=[pb.Item(data=truncated_jpeg()[:30])]), "invalid_image", 0),
    ]
    with grpc.insecure_channel(builtin_server.grpc_target) as channel:
        tokens = pb_grpc.EncoderStub(channel).Tokens
        for request_, type_, index in twins:
            err = _rpc_error(tokens, request_)
            md = dict(err.trailing_metadata() or ())
            assert (md.get("error-type"), md.get("error-index")) == (type_, None if index is None else str(index))
    spec = httpx.get(builtin_server.url + "/openapi.json").json()["paths"]["/v1/tokens"]["post"]
    assert {"200", "400", "413", "415", "422", "503", "504"} <= set(spec["responses"])


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    """A model that takes images only (the built-in one takes videos too)."""
    proc = start_server("--model", str(make_clip(tmp_path_factory.mktemp("clip_images_only"))), log_dir=server_logs)
    yield proc
    proc.stop()


def test_a_video_item_to_an_images_only_model_is_unsupported_modality_naming_it(
    clip_server: ServerProcess, stub: pb_grpc.EncoderStub
) -> None:
    """Uploaded or hash-only, over gRPC and through the client: a video is refused, not read as
    an image; an unknown modality number (a newer client's) is refused, not read as an image."""
    from encode_client import Client, ServerError, Video

    from tests.videos import make_video

    video = make_video(4, 2.0, 32, 32)
    images_only = pb_grpc.EncoderStub(grpc.insecure_channel(clip_server.grpc_target))
    image = pb.Item(data=image_bytes("PNG", 30, 20, seed=503))
    for item in (pb.Item(data=video, modality=pb.MODALITY_VIDEO), pb.Item(hash="cd" * 32, modality=pb.MODALITY_VIDEO)):
        for call, request_ in ((images_only.Encode, pb.EncodeRequest(items=[image, item])),
                               (images_only.Tokens, pb.TokensRequest(items=[image, item]))):
            if not item.HasField("data") and call is images_only.Tokens:
                continue  # a hash-only item is not a tokens item at all
            err = _rpc_error(call, request_)
            md = dict(err.trailing_metadata() or ())
            assert (err.code(), md.get("error-type"), md.get("error-index")) == (
                grpc.StatusCode.INVALID_ARGUMENT, "unsupported_modality", "1"), err.details()
    err = _rpc_error(stub.Encode, pb.EncodeRequest(items=[image, pb.Item(data=video, modality=7)]))
    md = dict(err.trailing_metadata() or ())
    assert (md.get("error-type"), md.get("error-index")) == ("invalid_request", "1") and "MODALITY_VIDEO" in (
        err.details() or "")
    for url in (clip_server.url, "grpc://" + clip_server.grpc_target):
        with Client(url, upload="hash-first") as client, pytest.raises(ServerError) as info:
            client.encode([Video(video)])
        assert (info.value.status, info.value.type, info.value.index) == (400, "unsupported_modality", 0), url
