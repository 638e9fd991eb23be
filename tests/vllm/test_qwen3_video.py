"""Qwen3-VL (dense and MoE) and Qwen3.5 videos through vLLM as an EC consumer, pixel-free
(``video_grid_thw`` + ``timestamps``, what vLLM 0.32's Qwen3-VL parser declares; Qwen3.5 and the
MoE model use its processing): the oracle, the negative control, parity with vLLM's own loader
(frame sampling), processor and tower, and token parity for several lengths, rates and sizes.

The fixtures are parametrized by model type at module scope: pytest runs every test for one
checkpoint (one engine, one encode-server) before the next; the videos and redis-server are shared.
Qwen3.5's text model needs bfloat16 on vLLM's CPU build (as in test_qwen3_vl.py): that engine runs
in bfloat16, encode-server stays float32 (the connector casts).

vLLM's side reads each file with its own video loader (``Qwen3VLVideoBackend.load_bytes``: OpenCV's
FFmpeg, 2 fps, at least 4 frames), as its OpenAI server does for a ``video_url``. The videos are
made in the test with PyAV, by the server's Python (this environment has no PyAV).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import PROMPT_HEAD, connector_config, engine, greedy, scheduler_connector
from tests.vllm.epd_stack import video_file
from tests.vllm.tiny_qwen3 import OUT_HIDDEN, make_tiny_qwen3
from tests.vllm.video_oracle import assert_zeros_change_the_answer, encode_video, video_rows

PREFIX = f"test-vllm-qwen3-video-{os.getpid()}"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT = PROMPT_HEAD + VIDEO + "describe the image<|im_end|>\n<|im_start|>assistant\n"
# (frames, fps, width, height): 2 s at 2 fps (4 frames, 2 groups), 2.5 s (5 frames padded to 6),
# 3 s at 10 fps (6 of 30 frames), 5 s at 4 fps (10 of 20) at 128x96; the last two are resized.
VIDEOS = [(4, 2.0, 64, 64), (5, 2.0, 64, 64), (30, 10.0, 96, 64), (20, 4.0, 128, 96), (12, 6.0, 100, 70),
          (16, 8.0, 50, 130)]
UNRESIZED = 4
# Qwen3.5-MoE is left out to save an engine (about 80 s): its tower and processor are Qwen3.5's.
# Adding it here (bfloat16) passes every test (run once: rows within 7.8e-3 x max |x|).
KINDS = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"]
ENGINE_DTYPE = {"qwen3_5": "bfloat16"}
# max |diff| of our rows from vLLM's loader + processor + tower, as a fraction of max |x|, for every
# video (resized ones included: the resize is torchvision's arithmetic here too). float32: float
# noise (vLLM's tower fuses q/k/v and interpolates its position grid its own way); bfloat16: vLLM's
# tower computes in bfloat16, ours in float32.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
PARITY_VIDEOS = [(4, 2.0, 64, 64), (7, 3.0, 64, 96), (25, 25.0, 160, 90), (3, 1.0, 320, 240), (48, 24.0, 64, 64),
                 (60, 30.0, 200, 100), (9, 2.0, 34, 258)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("videos")
    return [video_file(tmp, *spec) for spec in VIDEOS]


@pytest.fixture(scope="module")
def parity_files(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("parity_videos")
    return [video_file(tmp, *s) for s in PARITY_VIDEOS] + [video_file(tmp, 10, 5.0, 96, 64, "libvpx-vp9")]


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def qwen3_dir(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp(f"{kind}_video"), kind)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(qwen3_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
                        "--grpc-port", "0", "--max-batch-tokens", "96", "--dtype", "float32", log_dir=logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(kind: str, qwen3_dir: Path, redis_proc: RedisProcess, server: ServerProcess) -> Iterator[Any]:
    config = connector_config(redis_proc.url, server.url, PREFIX, timeout_ms=500)
    dtype = ENGINE_DTYPE.get(kind, "float32")
    with engine(qwen3_dir, config, limit_mm_per_prompt={"image": 1, "video": 1}, max_model_len=2048,
                dtype=dtype) as llm:
        print(f"\n{kind}: vLLM engine (EC consumer, video, {dtype}) started in {llm.startup_seconds:.1f} s")
        yield llm


def _metadata_only(meta: dict[str, Any], mm_hash: str) -> dict[str, Any]:
    import torch

    item = {"video_grid_thw": torch.tensor([meta["video_grid_thw"]]), "timestamps": [meta["timestamps"]]}
    return {"prompt": PROMPT, "multi_modal_data": {"video": item}, "multi_modal_uuids": {"video": [mm_hash]}}


def _direct(rows: np.ndarray, meta: dict[str, Any]) -> dict[str, Any]:
    import torch

    item = {"video_embeds": torch.tensor(rows), "video_grid_thw": torch.tensor([meta["video_grid_thw"]]),
            "timestamps": [meta["timestamps"]]}
    return {"prompt": PROMPT, "multi_modal_data": {"video": item}}


def _vllm_loaded(data: bytes) -> tuple[Any, dict[str, Any]]:
    """The frames and metadata vLLM's own loader gives for the file (its OpenAI server's path)."""
    from vllm.multimodal.video import Qwen3VLVideoBackend

    return Qwen3VLVideoBackend.load_bytes(data)


def _plain(data: bytes, uuid: str) -> dict[str, Any]:
    return {"prompt": PROMPT, "multi_modal_data": {"video": _vllm_loaded(data)}, "multi_modal_uuids": {"video": [uuid]}}


@pytest.fixture(scope="module")
def baseline(llm: Any, server: ServerProcess, videos: list[bytes]) -> dict[str, Any]:
    handed = [encode_video(server, v, "metadata") for v in videos]
    rows = [video_rows(encode_video(server, v, "embeddings")) for v in videos]
    metas = [h["meta"] for h in handed]
    hashes = [h["hash"] for h in handed]
    via_connector = greedy(llm, [_metadata_only(m, h) for m, h in zip(metas, hashes, strict=True)])
    direct = greedy(llm, [_direct(r, m) for r, m in zip(rows, metas, strict=True)])
    return {"metas": metas, "hashes": hashes, "rows": rows, "connector": via_connector, "direct": direct}


def test_video_tokens_through_the_connector_equal_direct_video_embeds(llm: Any, baseline: dict[str, Any]) -> None:
    """The oracle: metadata-only video items (grid + timestamps, uuid = mm_hash) give the tokens the
    same rows given directly as video_embeds give; the connector served every video."""
    assert baseline["connector"] == baseline["direct"]
    counts = scheduler_connector(llm).counts
    assert counts["hit"] >= len(VIDEOS) and counts["wrong_shape"] == 0, counts


def test_zeros_in_the_store_change_the_video_answer(
    llm: Any, server: ServerProcess, baseline: dict[str, Any], redis_proc: RedisProcess, videos: list[bytes]
) -> None:
    assert_zeros_change_the_answer(llm, server, redis_proc, PREFIX, baseline, videos, _metadata_only, _direct)


def test_video_rows_and_tokens_match_vllms_own_loader_and_tower(
    kind: str, llm: Any, videos: list[bytes], baseline: dict[str, Any]
) -> None:
    """vLLM's own path on the file (its loader samples, its processor resizes and patches, its tower
    encodes) gives encode-server's grid, timestamps and rows, every column (DeepStack blocks
    included), resized videos too: max |diff| <= TOLERANCE x max |x| (PyAV and OpenCV decode the
    H.264 stream with FFmpeg; the resize is torchvision's arithmetic in both). In float32, plain
    vLLM's greedy tokens equal the EPD request's; in bfloat16 they are printed (a bfloat16 tower's
    rows are not ours to the last bit, so a greedy token may flip)."""
    dtype = ENGINE_DTYPE.get(kind, "float32")
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    own_tokens = greedy(llm, [_plain(v, f"video-pixels-{i}") for i, v in enumerate(videos)])
    report = []
    for i, (data, meta, rows) in enumerate(zip(videos, baseline["metas"], baseline["rows"], strict=True)):
        _, vllm_meta = _vllm_loaded(data)
        own = runner.encoder_cache[f"video-pixels-{i}"].float().cpu().numpy()
        assert own.shape == rows.shape, (i, own.shape, rows.shape)
        blocks = own.shape[1] // OUT_HIDDEN
        diffs = [float(np.abs(a - b).max()) for a, b in zip(np.split(own, blocks, axis=1),
                                                            np.split(rows, blocks, axis=1), strict=True)]
        scale = float(np.abs(rows).max())
        same = own_tokens[i] == baseline["connector"][i]
        report.append(f"{kind} video {i} {VIDEOS[i]} ({'as is' if i < UNRESIZED else 'resized'}): vLLM sampled "
                      f"{len(vllm_meta['frames_indices'])} frames, grid {meta['video_grid_thw']}, {rows.shape[0]} x "
                      f"{rows.shape[1]}; max |diff| per block {' '.join(f'{d:.1e}' for d in diffs)} (of {scale:.1f}, "
                      f"{max(diffs) / scale:.1e} x max); greedy {'equal' if same else 'DIFFER'}")
        assert max(diffs) <= TOLERANCE[dtype] * max(1.0, scale), report[-1]
        if dtype == "float32":
            assert same, report[-1]
    print("\n" + "\n".join(report))


def test_video_pixels_equal_the_video_processors_bit_for_bit(qwen3_dir: Path, videos: list[bytes]) -> None:
    """The server's frames to pixel_values_videos (``qwen_video.patchify``, torch without
    torchvision) on the frames vLLM's loader decodes == the checkpoint's Qwen3VLVideoProcessor
    (transformers' torchvision backend, what vLLM calls), bit for bit, resized videos included."""
    import torch
    from transformers import AutoVideoProcessor

    from encode_server.encoders.qwen3_vl import _VIDEO_DEFAULTS, video_smart_resize
    from encode_server.encoders.qwen_video import VideoConfig, patchify

    processor = AutoVideoProcessor.from_pretrained(qwen3_dir)
    config = VideoConfig(processor.to_dict(), defaults=_VIDEO_DEFAULTS)
    for i, data in enumerate(videos):
        frames, _ = _vllm_loaded(data)
        theirs = processor(videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt")
        rows, grid = patchify(frames, video_smart_resize(*frames.shape[:3], config), config)
        assert [grid] == theirs["video_grid_thw"].tolist(), (i, grid, theirs["video_grid_thw"])
        pixels = theirs["pixel_values_videos"]
        assert torch.equal(rows, pixels), (i, VIDEOS[i], float((rows - pixels).abs().max()))


def test_video_token_parity_with_vllm_placeholders(llm: Any, server: ServerProcess, parity_files: list[bytes]) -> None:
    """/v1/tokens for a video, from its header alone, == vLLM's placeholder count (video pads) and
    the grid and timestamps its processor computes, over lengths, rates, sizes and containers."""
    from vllm import SamplingParams

    body = {"items": [{"data": base64.b64encode(f).decode(), "modality": "video"} for f in parity_files]}
    r = httpx.post(server.url + "/v1/tokens", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ours = r.json()["items"]
    video_token = llm.llm_engine.model_config.hf_config.video_token_id
    outs = llm.generate([_plain(f, f"count-{i}") for i, f in enumerate(parity_files)],
                        SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    theirs = [o.prompt_token_ids.count(video_token) for o in outs]
    assert [o["num_tokens"] for o in ours] == theirs, (ours, theirs)
    for f, mine in zip(parity_files, ours, strict=True):
        frames, vllm_meta = _vllm_loaded(f)
        assert len(vllm_meta["frames_indices"]) == len(frames)
        grid_t = -(-len(frames) // 2)
        assert mine["meta"]["video_grid_thw"][0] == grid_t, (mine, vllm_meta)
        assert len(mine["meta"]["timestamps"]) == grid_t


def test_a_video_for_an_image_only_family_is_refused(tmp_path: Path, logs: Path, videos: list[bytes]) -> None:
    from tests.tiny.llava import make_tiny_llava

    proc = start_server("--model", str(make_tiny_llava(tmp_path / "llava")), "--grpc-port", "0", log_dir=logs)
    try:
        body = {"items": [{"data": base64.b64encode(videos[0]).decode(), "modality": "video"}]}
        r = httpx.post(proc.url + "/v1/encode", json=body, timeout=30)
        assert (r.status_code, r.json()["error"]["type"]) == (400, "unsupported_modality"), r.text
    finally:
        proc.stop()
