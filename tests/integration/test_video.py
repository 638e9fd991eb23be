"""Video items over real HTTP and gRPC, through the Python client and the CLI, on a tiny Qwen3-VL
checkpoint (``--model DIR``): one item, one hash, the tokens from the header equal to the encode's,
and the bad-input corpus, each with its 4xx (its gRPC code), while every other request keeps working."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from blake3 import blake3

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests import tiny_models
from tests.images import image_bytes
from tests.server import ServerProcess, start_server
from tests.videos import make_video


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    path = tiny_models.make_qwen3(tmp_path_factory.mktemp("qwen3_vl"))
    proc = start_server("--model", str(path), "--max-video-seconds", "20", "--max-video-decoded-frames", "600",
                        "--max-wait-ms", "1", log_dir=server_logs)
    yield proc
    assert proc.stop() == 0, proc.log()


def _item(data: bytes, **extra: object) -> dict[str, object]:
    return {"data": base64.b64encode(data).decode(), "modality": "video", **extra}


def _post(server: ServerProcess, route: str, items: list[dict[str, object]]) -> httpx.Response:
    return httpx.post(server.url + route, json={"items": items}, timeout=60)


GOOD = make_video(10, 4.0, 64, 96)  # 2.5 s: 5 frames sampled, 3 groups of 6 rows


def test_a_video_is_one_item_with_one_hash_and_its_tokens_from_the_header(server: ServerProcess) -> None:
    r = _post(server, "/v1/encode", [_item(GOOD)])
    assert r.status_code == 200, r.text
    item = r.json()["items"][0]
    assert (item["status"], item["hash"]) == ("encoded", blake3(GOOD).hexdigest())
    assert item["meta"]["video_grid_thw"] == [3, 6, 4] and len(item["meta"]["timestamps"]) == 3
    assert item["shape"] == [item["num_tokens"], 192] and item["num_tokens"] == 3 * 6 * 4 // 4
    counted = _post(server, "/v1/tokens", [_item(GOOD)]).json()["items"][0]
    assert (counted["num_tokens"], counted["meta"], counted["width"], counted["height"]) == (
        item["num_tokens"], item["meta"], 64, 96)
    hit = _post(server, "/v1/encode", [{"hash": item["hash"], "modality": "video"}]).json()["items"][0]
    assert (hit["status"], hit["embedding"]) == ("hit", item["embedding"])


def test_other_containers_and_forms_of_upload(server: ServerProcess) -> None:
    webm = make_video(6, 3.0, 64, 64, codec="libvpx-vp9")
    as_json = _post(server, "/v1/encode", [_item(webm)])
    assert as_json.status_code == 200, as_json.text
    url = "data:video/webm;base64," + base64.b64encode(webm).decode()
    as_url = httpx.post(server.url + "/v1/encode", json={"items": [{"data": url}]}, timeout=60)
    raw = httpx.post(server.url + "/v1/encode", content=webm, headers={"Content-Type": "video/webm"}, timeout=60)
    part = httpx.post(server.url + "/v1/encode", files=[("f", ("v.webm", webm, "video/webm"))], timeout=60)
    for r in (as_url, raw, part):
        assert r.status_code == 200, r.text
        assert r.json()["items"][0]["meta"] == as_json.json()["items"][0]["meta"]
        assert r.json()["items"][0]["hash"] == blake3(webm).hexdigest()


CORPUS = {
    "random bytes": (bytes(range(256)) * 40, 400, "invalid_video"),
    "empty": (b"", 400, "invalid_video"),
    "truncated mp4": (GOOD[: len(GOOD) // 2], 400, "invalid_video"),
    "one frame": (make_video(1, 2.0, 64, 64), 400, "invalid_video"),
    "a gif": (make_video(4, 2.0, 64, 64, codec="gif"), 415, "unsupported_video"),
    "too long": (make_video(50, 2.0, 32, 32), 413, "video_too_large"),
    # 10 s in its header, but at 100 fps: 1,000 frames to decode, above the fixture's 600
    "too many frames to decode": (make_video(1000, 100.0, 16, 16), 413, "video_too_large"),
    "an image": (base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    ), 400, "invalid_video"),
}


@pytest.mark.parametrize("case", list(CORPUS))
def test_bad_videos_get_their_4xx_naming_the_item_and_the_server_goes_on(server: ServerProcess, case: str) -> None:
    data, status, error = CORPUS[case]
    for route in ("/v1/encode", "/v1/tokens"):
        if case == "empty" and route == "/v1/tokens":
            continue
        r = _post(server, route, [_item(GOOD), _item(data)])
        assert r.status_code == status, (route, r.text)
        body = r.json()["error"]
        assert (body["type"], body["index"]) == (error, 1), (route, body)
    assert _post(server, "/v1/encode", [_item(GOOD)]).status_code == 200


def test_an_item_sent_as_the_other_modality_is_told_which_its_bytes_are(server: ServerProcess) -> None:
    # Bytes no test has encoded: a cached mm_hash would be a hit, whatever the modality sent.
    png, mp4 = CORPUS["an image"][0], make_video(6, 3.0, 32, 32, seed=77)
    cases = [(png, "video/mp4", "invalid_video", "its bytes are PNG image data: send it as an image"),
             (mp4, "image/png", "invalid_image", "its bytes are mp4 video data: send it as a video")]
    for data, content_type, error, hint in cases:
        for route in ("/v1/encode", "/v1/tokens"):
            r = httpx.post(server.url + route, content=data, headers={"Content-Type": content_type}, timeout=60)
            assert r.status_code == 400, (route, r.text)
            body = r.json()["error"]
            assert (body["type"], body["index"]) == (error, 0) and hint in body["message"], (route, body)


def test_a_hash_only_item_never_returns_the_entry_of_the_other_modality(server: ServerProcess) -> None:
    """One file's bytes as an image and as a video are two entries: a hash-only video of an
    encoded image's hash is a miss (not the image's rows and meta), and the other way round; so is
    each one's lookup, over HTTP, gRPC and the client."""
    from encode_client import Client

    png, mp4 = image_bytes(width=56, height=56, seed=91), make_video(6, 3.0, 32, 32, seed=91)
    image = httpx.post(server.url + "/v1/encode", content=png, headers={"Content-Type": "image/png"}, timeout=60)
    video = _post(server, "/v1/encode", [_item(mp4)])
    assert image.status_code == video.status_code == 200, (image.text, video.text)
    png_hash, mp4_hash = blake3(png).hexdigest(), blake3(mp4).hexdigest()
    crossed = _post(server, "/v1/encode", [{"hash": png_hash, "modality": "video"}, {"hash": mp4_hash}])
    assert [i["status"] for i in crossed.json()["items"]] == ["miss", "miss"], crossed.text
    same = _post(server, "/v1/encode", [{"hash": png_hash}, {"hash": mp4_hash, "modality": "video"}])
    assert [i["status"] for i in same.json()["items"]] == ["hit", "hit"], same.text
    for modality, cached in (("image", [True, False]), ("video", [False, True])):
        body = {"hashes": [png_hash, mp4_hash], **({"modality": modality} if modality == "video" else {})}
        r = httpx.post(server.url + "/v1/lookup", json=body, timeout=60)
        assert [i["cached"] for i in r.json()["items"]] == cached, (modality, r.text)
        with grpc.insecure_channel(server.grpc_target) as channel:
            kind = pb.MODALITY_VIDEO if modality == "video" else pb.MODALITY_IMAGE
            found = pb_grpc.EncoderStub(channel).Lookup(pb.LookupRequest(hashes=[png_hash, mp4_hash], modality=kind))
        assert [i.cached for i in found.items] == cached, modality
        with Client(server.url) as client:
            assert [i.cached for i in client.lookup([png_hash, mp4_hash], modality=modality)] == cached, modality


# -- gRPC, the Python client and the CLI, on the same server ----------------------------------------

_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
               415: grpc.StatusCode.INVALID_ARGUMENT}


def _video(data: bytes, **fields: object) -> pb.Item:
    return pb.Item(data=data, modality=pb.MODALITY_VIDEO, **fields)


def test_grpc_encodes_a_video_as_http_does_and_its_hash_alone_is_a_hit(server: ServerProcess) -> None:
    clip = make_video(8, 4.0, 64, 64, seed=7)  # 2 s: 4 frames, 2 groups
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        item = stub.Encode(pb.EncodeRequest(items=[_video(clip)]), timeout=60).items[0]
        assert (item.status, item.source, item.hash) == ("encoded", "encoder", blake3(clip).hexdigest())
        meta = json.loads(item.meta_json)
        assert meta["video_grid_thw"] == [2, 4, 4] and len(meta["timestamps"]) == 2
        assert list(item.embedding.shape) == [item.num_tokens, 192] and item.num_tokens == 2 * 4 * 4 // 4
        hit = stub.Encode(pb.EncodeRequest(items=[pb.Item(hash=item.hash, modality=pb.MODALITY_VIDEO)]),
                          timeout=60).items[0]
        assert (hit.status, hit.source, hit.embedding.data) == ("hit", "local", item.embedding.data)
        counted = stub.Tokens(pb.TokensRequest(items=[_video(clip)]), timeout=60).items[0]
        assert (counted.num_tokens, json.loads(counted.meta_json), counted.width, counted.height) == (
            item.num_tokens, meta, 64, 64)
    http = _post(server, "/v1/encode", [{"hash": item.hash, "modality": "video"}]).json()["items"][0]
    assert base64.b64decode(http["embedding"]) == item.embedding.data and http["meta"] == meta


def test_bad_videos_over_grpc_get_the_documented_code_naming_the_item(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        for case, (data, status, error) in CORPUS.items():
            for call, request_ in ((stub.Encode, pb.EncodeRequest(items=[_video(GOOD), _video(data)])),
                                   (stub.Tokens, pb.TokensRequest(items=[_video(GOOD), _video(data)]))):
                with pytest.raises(grpc.RpcError) as info:
                    call(request_, timeout=60)
                md = dict(info.value.trailing_metadata() or ())
                assert (info.value.code(), md.get("error-type"), md.get("error-index")) == (
                    _GRPC_CODES[status], error, "1"), (case, info.value.details())


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_the_client_sends_videos_by_content_suffix_or_wrapper_hash_first(
    server: ServerProcess, tmp_path: Path, door: str
) -> None:
    """A path ending in .mp4, webm bytes (sniffed) and a wrapped Video of an unknown name: each
    one video item; the repeat costs hashes only and hits; tokens from the header equal the rows;
    a refused video is the server's error, naming it, with the HTTP status on both doors."""
    from encode_client import Client, ServerError, Video

    seed = {"http": 11, "grpc": 12}[door]
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_video(8, 4.0, 64, 64, seed=seed))
    webm = make_video(6, 3.0, 64, 32, codec="libvpx-vp9", seed=seed)
    opaque = tmp_path / "clip.bin"  # MPEG-TS: no magic number, so only the wrapper says "video"
    opaque.write_bytes(make_video(5, 2.0, 32, 64, seed=seed, container_format="mpegts"))
    inputs = [str(path), webm, Video(opaque)]
    url = server.url if door == "http" else "grpc://" + server.grpc_target
    with Client(url, upload="hash-first") as client:
        first = client.encode(inputs)
        assert [r.status for r in first] == ["encoded"] * 3 and client.stats.uploaded_bytes == sum(
            len(blob) for blob in (path.read_bytes(), webm, opaque.read_bytes()))
        assert all("video_grid_thw" in r.meta and r.shape == (r.num_tokens, 192) for r in first)
        again = client.encode(inputs)
        assert [(r.status, r.source) for r in again] == [("hit", "local")] * 3
        assert client.stats.uploaded_bytes == sum(len(blob) for blob in (path.read_bytes(), webm, opaque.read_bytes()))
        assert [r.data for r in again] == [r.data for r in first]
        counts = client.tokens(inputs)
        assert [(c.num_tokens, c.meta) for c in counts] == [(r.num_tokens, r.meta) for r in first]
        assert [(c.width, c.height) for c in counts] == [(64, 64), (64, 32), (32, 64)]
        for bad, status, error in (CORPUS["a gif"], CORPUS["too long"], CORPUS["truncated mp4"]):
            with pytest.raises(ServerError) as info:
                client.encode([str(path), Video(bad)])
            assert (info.value.status, info.value.type, info.value.index) == (status, error, 1), info.value


def _cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODE_CLIENT_")}
    return subprocess.run([sys.executable, "-m", "encode_client.cli", *args, "--url", url],
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_cli_takes_videos_by_suffix_or_with_video(server: ServerProcess, tmp_path: Path) -> None:
    from safetensors import safe_open

    clip, opaque = tmp_path / "clip.webm", tmp_path / "clip.dat"
    clip.write_bytes(make_video(6, 3.0, 64, 64, codec="libvpx-vp9", seed=21))
    opaque.write_bytes(make_video(8, 4.0, 32, 32, seed=22, container_format="mpegts"))  # no magic number
    grpc_url = "grpc://" + server.grpc_target
    counted = _cli("tokens", str(clip), url=grpc_url)
    assert counted.returncode == 0, counted.stderr
    out = tmp_path / "out.safetensors"
    encoded = _cli("encode", str(clip), "-o", str(out), url=server.url)
    assert encoded.returncode == 0, encoded.stderr
    with safe_open(str(out), "pt") as f:
        (item,) = json.loads(f.metadata()["items"])
        assert f.get_tensor("0").shape == (item["num_tokens"], 192)
    assert counted.stdout.split()[0] == str(item["num_tokens"]) and "video_grid_thw" in item["meta"]
    # Not a video by name or content? --video says so; without it the file is an image, and refused.
    as_video = _cli("tokens", "--video", str(opaque), url=server.url)
    assert as_video.returncode == 0 and "video_grid_thw" in as_video.stdout, as_video.stderr
    as_image = _cli("tokens", str(opaque), url=server.url)
    assert as_image.returncode == 1 and "invalid_image" in as_image.stderr, as_image.stderr
    looked = _cli("lookup", str(clip), str(opaque), url=grpc_url)
    assert [line.split()[1] for line in looked.stdout.splitlines()] == ["cached", "missing"], looked.stderr
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.webm").write_bytes(clip.read_bytes())
    (folder / "b.mp4").write_bytes(opaque.read_bytes())
    warmed = _cli("warm", str(folder), url=grpc_url)
    assert warmed.returncode == 0 and "warmed 0 images and 2 videos" in warmed.stderr, warmed.stderr
    assert "1 hit, 1 miss" in warmed.stderr, warmed.stderr
