"""Video items over real HTTP on a tiny Qwen3-VL checkpoint (``--model DIR``): one item, one hash,
the tokens from the header equal to the encode's, and the bad-input corpus, each with its 4xx,
while every other request keeps working."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from tests import tiny_models
from tests.server import ServerProcess, start_server
from tests.videos import make_video


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[ServerProcess]:
    path = tiny_models.make_qwen3(tmp_path_factory.mktemp("qwen3_vl"))
    proc = start_server("--model", str(path), "--max-video-seconds", "20", "--max-wait-ms", "1", log_dir=server_logs)
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
    hit = _post(server, "/v1/encode", [{"hash": item["hash"]}]).json()["items"][0]
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
