"""Per-request processor settings (``mm_processor_kwargs``) over real HTTP: off by default with a
400 naming the flag; on, their own entries, the same count from /v1/tokens as the rows of an
encode, bad keys refused naming the item, and GET /v1/model publishing the keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.calls import b64, encode, h
from tests.images import image_bytes
from tests.server import ServerProcess, start_server

IMAGE = image_bytes("PNG", 280, 280, seed=33)
FEWER = {"max_pixels": 12544}


@pytest.fixture(scope="module")
def trusting_server(server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server("--trust-request-mm-kwargs", "--max-image-pixels", str(2048 * 2048), "--cache-mb", "16",
                          log_dir=server_logs)
    yield server
    assert server.stop() == 0, server.log()


def _error(r: httpx.Response) -> tuple[int, str, int | None, str]:
    error = r.json()["error"]
    return r.status_code, error["type"], error["index"], error["message"]


def test_settings_on_a_server_without_the_flag_are_a_400_naming_it(builtin_server: ServerProcess) -> None:
    r = encode(builtin_server, [{"data": b64(IMAGE)}], mm_processor_kwargs=FEWER)
    status, kind, index, message = _error(r)
    assert (status, kind, index) == (400, "settings_disabled", 0) and "--trust-request-mm-kwargs" in message
    model = httpx.get(builtin_server.url + "/v1/model", timeout=10).json()
    assert model["mm_processor_kwargs"]["enabled"] is False


def test_the_model_publishes_its_familys_keys_with_the_servers_caps(trusting_server: ServerProcess) -> None:
    published = httpx.get(trusting_server.url + "/v1/model", timeout=10).json()["mm_processor_kwargs"]
    assert published["enabled"] is True
    assert set(published["keys"]) == {"min_pixels", "max_pixels", "fps"}
    # a video's rate: vLLM takes it in media_io_kwargs.video; its default is the server's --video-fps
    assert published["keys"]["fps"] | {"meaning": ""} == {
        "type": "float", "minimum": None, "maximum": 30, "exclusive_minimum": 0, "default": 2.0,
        "modalities": ["video"], "vllm_field": "media_io_kwargs.video", "meaning": ""}
    # the built-in processor's max_pixels, below --max-image-pixels: never more than the warm-up ran
    assert published["keys"]["max_pixels"]["default"] == published["keys"]["max_pixels"]["maximum"] == 448 * 448
    assert published["keys"]["min_pixels"]["maximum"] == 448 * 448


def test_request_and_item_settings_key_their_own_entries_and_tokens_count_their_rows(
    trusting_server: ServerProcess,
) -> None:
    plain = encode(trusting_server, [{"data": b64(IMAGE)}]).json()["items"][0]
    fewer = encode(trusting_server, [{"data": b64(IMAGE)}], mm_processor_kwargs=FEWER).json()["items"][0]
    assert fewer["status"] == "encoded" and fewer["num_tokens"] < plain["num_tokens"]
    # The item's own setting over the request's; the same setting by hash alone is a hit.
    items = [{"hash": h(IMAGE), "mm_processor_kwargs": FEWER}, {"hash": h(IMAGE)}]
    both = encode(trusting_server, items, mm_processor_kwargs={"max_pixels": 448 * 448}).json()["items"]
    assert [i["status"] for i in both] == ["hit", "hit"]
    assert (both[0]["embedding"], both[1]["embedding"]) == (fewer["embedding"], plain["embedding"])
    tokens = httpx.post(trusting_server.url + "/v1/tokens", json={"sizes": [[280, 280]], "mm_processor_kwargs": FEWER},
                        timeout=30).json()["items"][0]
    assert (tokens["num_tokens"], tokens["meta"]) == (fewer["num_tokens"], fewer["meta"])
    found = httpx.post(trusting_server.url + "/v1/lookup", json={"hashes": [h(IMAGE)], "mm_processor_kwargs": FEWER},
                       timeout=30).json()["items"][0]
    assert found["cached"] is True
    unseen = httpx.post(trusting_server.url + "/v1/lookup",
                        json={"hashes": [h(IMAGE)], "mm_processor_kwargs": {"max_pixels": 12545}}, timeout=30)
    assert unseen.json()["items"][0]["cached"] is False


@pytest.mark.parametrize(
    ("settings", "words"),
    [({"max_pixel": 9}, "mm_processor_kwargs.max_pixel is not a setting"),
     ({"max_pixels": "9"}, "max_pixels must be an integer"),
     ({"min_pixels": 448 * 448 + 1}, "at most 200704 (the checkpoint's max_pixels)")],
)
def test_a_bad_setting_is_a_400_naming_the_key_and_the_item(
    trusting_server: ServerProcess, settings: dict[str, object], words: str
) -> None:
    r = encode(trusting_server, [{"data": b64(IMAGE)}, {"data": b64(IMAGE), "mm_processor_kwargs": settings}])
    status, kind, index, message = _error(r)
    assert (status, kind, index) == (400, "invalid_setting", 1) and words in message, message
    r = httpx.post(trusting_server.url + "/v1/tokens", json={"sizes": [[9, 9], [280, 280]],
                                                              "mm_processor_kwargs": settings}, timeout=30)
    assert _error(r)[:3] == (400, "invalid_setting", 0)


def test_a_videos_fps_over_http_counts_its_rows_and_a_bad_one_is_a_400_naming_the_key_and_the_item(
    trusting_server: ServerProcess,
) -> None:
    from tests.videos import make_video

    clip = b64(make_video(21, 6.0, 56, 56, seed=34))  # 6 frames at 2 fps, 14 at 4 fps: 3 and 7 groups

    def tokens(*settings: dict[str, object] | None) -> httpx.Response:
        items = [{"data": clip, "modality": "video", **({"mm_processor_kwargs": s} if s else {})} for s in settings]
        return httpx.post(trusting_server.url + "/v1/tokens", json={"items": items}, timeout=30)

    counted = tokens(None, {"fps": 4}).json()["items"]
    assert [i["meta"]["video_grid_thw"][0] for i in counted] == [3, 7]
    encoded = encode(trusting_server, [{"data": clip, "modality": "video", "mm_processor_kwargs": {"fps": 4}}])
    assert encoded.json()["items"][0]["num_tokens"] == counted[1]["num_tokens"]
    for settings, words in (({"fps": 0}, "mm_processor_kwargs.fps must be above 0"),
                            ({"num_frames": 8}, "mm_processor_kwargs.num_frames is not a setting"),
                            ({"max_pixels": 9}, "max_pixels does not apply to a video")):
        status, kind, index, message = _error(tokens(None, settings))
        assert (status, kind, index) == (400, "invalid_setting", 1) and words in message, message


def test_settings_that_are_not_an_object_are_a_422_naming_the_item(trusting_server: ServerProcess) -> None:
    r = encode(trusting_server, [{"data": b64(IMAGE), "mm_processor_kwargs": [1]}])
    assert _error(r)[:3] == (422, "invalid_request", 0)


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_the_python_client_sends_settings_over_either_door_and_gets_their_own_entries(
    trusting_server: ServerProcess, scheme: str
) -> None:
    from encode_client import Client

    url = trusting_server.url if scheme == "http" else f"grpc://{trusting_server.grpc_target}"
    data = image_bytes("PNG", 280, 280, seed=40 + len(scheme))
    with Client(url, response="json", timeout=30) as client:
        plain, = client.encode([data])
        fewer, = client.encode([data], mm_processor_kwargs=FEWER)
        again, = client.encode([data], mm_processor_kwargs={"max_pixels": FEWER["max_pixels"], "min_pixels": 3136})
        assert (plain.num_tokens, fewer.num_tokens) == (100, 16)
        assert again.status == "hit" and again.data == fewer.data
        counted, = client.tokens(sizes=[(280, 280)], mm_processor_kwargs=FEWER)
        assert counted.num_tokens == 16
        assert client.lookup([h(data)], mm_processor_kwargs=FEWER)[0].cached
        assert not client.lookup([h(data)], mm_processor_kwargs={"max_pixels": 12545})[0].cached
        with pytest.raises(Exception, match="invalid_setting"):
            client.encode([data], mm_processor_kwargs={"max_pixel": 1})


def test_grpc_settings_that_are_not_a_json_object_are_refused_naming_the_item(trusting_server: ServerProcess) -> None:
    import grpc

    from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
    from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(trusting_server.grpc_target) as channel:
        stub = pb_grpc.EncoderStub(channel)
        item = pb.Item(data=IMAGE, mm_processor_kwargs_json="[1]")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Encode(pb.EncodeRequest(items=[pb.Item(data=IMAGE), item]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must be a JSON object" in (refused.value.details() or "")


def test_the_cli_takes_settings_for_tokens_encode_and_lookup(trusting_server: ServerProcess, tmp_path: Path) -> None:
    from tests.integration.test_cli import cli

    image = tmp_path / "a.png"
    image.write_bytes(image_bytes("PNG", 280, 280, seed=50))
    settings = json.dumps(FEWER)
    tokens = cli("tokens", str(image), "--mm-processor-kwargs", settings, url=trusting_server.url)
    assert tokens.returncode == 0 and tokens.stdout.split()[0] == "16", tokens.stderr
    assert cli("tokens", str(image), url=trusting_server.url).stdout.split()[0] == "100"
    out = tmp_path / "out.safetensors"
    encoded = cli("encode", str(image), "-o", str(out), "--mm-processor-kwargs", settings, url=trusting_server.url)
    assert encoded.returncode == 0 and "[16, 128]" in encoded.stdout, encoded.stderr
    found = cli("lookup", str(image), "--mm-processor-kwargs", settings, url=trusting_server.url)
    assert found.returncode == 0 and " cached " in found.stdout, found.stdout
    refused = cli("tokens", str(image), "--mm-processor-kwargs", "[1]", url=trusting_server.url)
    assert refused.returncode == 2 and "must be a JSON object" in refused.stderr
