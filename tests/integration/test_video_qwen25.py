"""Video items on a tiny Qwen2.5-VL checkpoint with its own video processor config, over real HTTP:
one item, one hash, ``/v1/tokens`` from the header equal to the encode's rows, grid and
``second_per_grid_ts``, and a fingerprint that covers the video settings (the checkpoint's and the
server's frame rate)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.server import ServerProcess, start_server
from tests.videos import make_video
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"), video={}, layout="nested")


@pytest.fixture(scope="module")
def server(checkpoint: Path, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(checkpoint), "--dtype", "float32", "--max-batch-tokens", "64",
                        "--max-wait-ms", "1", log_dir=server_logs)
    yield proc
    assert proc.stop() == 0, proc.log()


def _post(server: ServerProcess, route: str, data: bytes) -> dict[str, object]:
    body = {"items": [{"data": base64.b64encode(data).decode(), "modality": "video"}]}
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json()["items"][0])


@pytest.mark.parametrize(
    ("spec", "grid", "seconds"),
    # 2.5 s: 4 of 5 frames (whole groups), 1.25 s per group; 3 s at 10 fps, 6 of 30 frames, resized
    # to 84 x 56 (above --max-batch-tokens: encoded in runs of groups); 2 s of 4 frames, 1.0 s.
    [((5, 2.0, 56, 56), [2, 4, 4], 1.25), ((30, 10.0, 96, 64), [3, 4, 6], 1.0), ((4, 2.0, 84, 56), [2, 4, 6], 1.0)],
)
def test_a_video_is_one_item_and_its_tokens_come_from_the_header(
    server: ServerProcess, spec: tuple[int, float, int, int], grid: list[int], seconds: float
) -> None:
    count, fps, width, height = spec
    video = make_video(count, fps, width, height)
    item = _post(server, "/v1/encode", video)
    assert (item["status"], item["hash"]) == ("encoded", blake3(video).hexdigest())
    assert item["meta"] == {"video_grid_thw": grid, "second_per_grid_ts": seconds}
    assert item["shape"] == [item["num_tokens"], 64] and item["num_tokens"] == grid[0] * grid[1] * grid[2] // 4
    counted = _post(server, "/v1/tokens", video)
    assert (counted["num_tokens"], counted["meta"], counted["width"], counted["height"]) == (
        item["num_tokens"], item["meta"], width, height)
    hit = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": item["hash"], "modality": "video"}]},
                     timeout=60).json()
    assert (hit["items"][0]["status"], hit["items"][0]["embedding"]) == ("hit", item["embedding"])


def test_the_served_fingerprint_covers_the_video_settings(server: ServerProcess, checkpoint: Path) -> None:
    info = load_encoder(str(checkpoint), device="cpu", dtype="float32").info
    served = httpx.get(server.url + "/v1/model").json()["fingerprint"]
    assert served == model_fingerprint(info, {"fps": 2.0})
    assert served != model_fingerprint(info, {"fps": 1.0})
    assert info.preprocessing["video_processor"]["video_processor_type"] == "Qwen2VLVideoProcessor"
