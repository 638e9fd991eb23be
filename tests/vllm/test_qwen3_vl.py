"""Qwen3-VL (dense, MoE) and Qwen3.5 (dense, MoE) images and videos through vLLM as an EC
consumer, pixel-free: the oracle, the negative control, parity with vLLM's own tower (DeepStack
columns included), loader and processor, placeholder counts, and the connector's width check on the
wide DeepStack rows.

One engine at a time: the module's fixtures are parametrized by model type, so pytest runs every
test for one checkpoint (one engine taking images and a video, one encode-server, one
redis-server) before the next. Qwen3.5's text model needs bfloat16 on vLLM's CPU build (its gated
delta-net kernels refuse float32): that engine runs in bfloat16; encode-server stays float32 (the
connector casts).

vLLM's side reads each video file with its own video loader (``Qwen3VLVideoBackend.load_bytes``:
OpenCV's FFmpeg, 2 fps, at least 4 frames), as its OpenAI server does for a ``video_url``. The
videos are made in the test with PyAV, by the server's Python (this environment has no PyAV).
"""

from __future__ import annotations

import base64
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from encode_client import Client
from encode_client.keys import own_identifier, store_key

from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    PROMPT_HEAD,
    connector_config,
    direct_embeds,
    engine,
    greedy,
    metadata_only,
    pixels,
    png,
    scheduler_connector,
    stored_value,
    tiny_checkpoint,
)
from tests.vllm.epd_stack import video_files
from tests.vllm.tiny_qwen3 import DEEPSTACK, MAX_PIXELS, MIN_PIXELS, OUT_HIDDEN, make_tiny_qwen3
from tests.vllm.video_oracle import assert_zeros_change_the_answer, encode_video, video_rows

PREFIX = f"test-vllm-qwen3-{os.getpid()}"
KINDS = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
ENGINE_DTYPE = {"qwen3_5": "bfloat16", "qwen3_5_moe": "bfloat16"}
# width x height. The first three are multiples of 32 within [min_pixels, max_pixels]: not resized.
SIZES = [(64, 64), (96, 64), (256, 192), (100, 70), (300, 260), (20, 300)]
UNRESIZED = 3
IMAGES = [png(w, h, seed=10 + i) for i, (w, h) in enumerate(SIZES)]
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_PROMPT = PROMPT_HEAD + VIDEO + "describe the image<|im_end|>\n<|im_start|>assistant\n"
# (frames, fps, width, height): 2 s at 2 fps (4 frames, 2 groups), 2.5 s (5 frames padded to 6),
# 3 s at 10 fps (6 of 30 frames), 5 s at 4 fps (10 of 20) at 128x96; the last two are resized.
VIDEOS = [(4, 2.0, 64, 64), (5, 2.0, 64, 64), (30, 10.0, 96, 64), (20, 4.0, 128, 96), (12, 6.0, 100, 70),
          (16, 8.0, 50, 130)]
VIDEO_UNRESIZED = 4
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
    return video_files(tmp, VIDEOS)


@pytest.fixture(scope="module")
def parity_files(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("parity_videos")
    return video_files(tmp, [*PARITY_VIDEOS, (10, 5.0, 96, 64, "libvpx-vp9")])


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def qwen3_dir(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_qwen3, kind=kind)


@pytest.fixture(scope="module")
def redis_proc(kind: str) -> Iterator[RedisProcess]:
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(qwen3_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
        "--grpc-port", "0", "--max-batch-tokens", "96", "--dtype", "float32", log_dir=logs,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, response="json", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(kind: str, qwen3_dir: Path, redis_proc: RedisProcess, server: ServerProcess) -> Iterator[Any]:
    config = connector_config(redis_proc.url, server.url, PREFIX, timeout_ms=500)
    dtype = ENGINE_DTYPE.get(kind, "float32")
    # With its tower (plain vLLM on the pixels and the files too), images and a video per prompt.
    with engine(qwen3_dir, config, tower=True, dtype=dtype, limit_mm_per_prompt={"image": 4, "video": 1},
                max_model_len=2048) as llm:
        print(f"\n{kind}: vLLM engine (EC consumer, images and video, {dtype}) started in {llm.startup_seconds:.1f} s")
        yield llm


@pytest.fixture(scope="module")
def baseline(llm: Any, client: Client) -> dict[str, Any]:
    """Every image handed off to encode-server; the greedy tokens of the EPD request (metadata
    only, uuid = mm_hash) and of the same embeddings given directly."""
    results = client.hand_off(IMAGES)
    grids = [r.meta["image_grid_thw"] for r in results]
    hashes = [r.hash for r in results]
    embeddings = [r.numpy() for r in client.encode(IMAGES)]
    via_connector = greedy(llm, [metadata_only(g, h) for g, h in zip(grids, hashes, strict=True)])
    direct = greedy(llm, [direct_embeds(e, g) for e, g in zip(embeddings, grids, strict=True)])
    return {"grids": grids, "hashes": hashes, "embeddings": embeddings, "connector": via_connector, "direct": direct}


def _width(kind: str) -> int:
    return OUT_HIDDEN * (1 + len(DEEPSTACK)) if kind.startswith("qwen3_vl") else OUT_HIDDEN


def test_consumer_tokens_equal_direct_image_embeds(kind: str, llm: Any, baseline: dict[str, Any]) -> None:
    """The oracle: the connector's (wide, DeepStack-packed) rows give the tokens the same rows
    given to vLLM as image_embeds give; the connector served every image, with no pixels."""
    assert all(e.shape[1] == _width(kind) for e in baseline["embeddings"])
    assert baseline["connector"] == baseline["direct"]
    counts = scheduler_connector(llm).counts
    assert counts["hit"] >= len(IMAGES) and counts["wrong_shape"] == 0, counts


def test_zeros_in_the_store_change_the_answer(
    llm: Any, client: Client, baseline: dict[str, Any], redis_proc: RedisProcess
) -> None:
    """Zeros of the same (wide) shape under each key: the EPD tokens become those of zeros given
    directly, and differ from the real ones. Then the real values are written back."""
    fingerprint = str(client.model()["fingerprint"])
    redis = redis_proc.client()
    zero_requests, zero_direct = [], []
    for h, grid, emb in zip(baseline["hashes"], baseline["grids"], baseline["embeddings"], strict=True):
        zeros = np.zeros_like(emb)
        value = stored_value(zeros, fingerprint, h, {"image_grid_thw": grid})
        redis.set(store_key(fingerprint, h, prefix=PREFIX), value)
        zero_requests.append(metadata_only(grid, h))
        zero_direct.append(direct_embeds(zeros, grid))
    llm.llm_engine.reset_encoder_cache()
    via_connector = greedy(llm, zero_requests)
    assert via_connector == greedy(llm, zero_direct)
    for i, (zero, real) in enumerate(zip(via_connector, baseline["connector"], strict=True)):
        assert zero != real, f"image {i}: zeros gave the same tokens as its embedding"
    client.hand_off(IMAGES)
    llm.llm_engine.reset_encoder_cache()
    assert greedy(llm, [metadata_only(g, h) for g, h in zip(baseline["grids"], baseline["hashes"], strict=True)]) == (
        baseline["connector"]
    )


def test_a_value_of_the_language_models_width_is_refused(
    kind: str, llm: Any, client: Client, baseline: dict[str, Any], redis_proc: RedisProcess
) -> None:
    """With DeepStack, a value only out_hidden_size wide (the main features alone: what an E that
    forgot DeepStack would store) is not the server's width: the connector refuses it and, the
    server still holding the real value, fetches that instead (issue 21's fallback): the request
    is answered, never run on half an embedding."""
    if not kind.startswith("qwen3_vl"):
        pytest.skip("Qwen3.5 has no DeepStack: its width is the language model's")
    fingerprint = str(client.model()["fingerprint"])
    h, grid, emb = baseline["hashes"][0], baseline["grids"][0], baseline["embeddings"][0]
    narrow = np.ascontiguousarray(emb[:, :OUT_HIDDEN])
    value = stored_value(narrow, fingerprint, h, {"image_grid_thw": grid})
    redis_proc.client().set(store_key(fingerprint, h, prefix=PREFIX), value)
    before = scheduler_connector(llm).counts["wrong_shape"]
    llm.llm_engine.reset_encoder_cache()
    from vllm import SamplingParams

    out = llm.generate([metadata_only(grid, h)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].finish_reason != "error"
    assert scheduler_connector(llm).counts["wrong_shape"] > before
    client.hand_off(IMAGES[:1])  # the real value back


def test_embedding_and_tokens_match_vllms_own_vision_tower(kind: str, llm: Any, baseline: dict[str, Any]) -> None:
    """encode-server's embedding == vLLM's own tower for the same image, every column (the
    DeepStack blocks included), and plain vLLM on the pixels gives the EPD request's tokens.

    float32 engine: max |diff| <= 1e-5 x the largest magnitude (float32 noise: vLLM's tower fuses
    q/k/v and interpolates its position grid its own way).
    bfloat16 engine (Qwen3.5): vLLM's tower computes in bfloat16, ours in float32: <= 1e-2 x max |x|
    (measured: <= 7.5e-3).
    Resized images too: encode-server makes the torchvision-backend processor's pixels (vLLM's)
    with the same torch operations (test_connector_with_tower.py).
    """
    own_tokens = greedy(llm, [pixels(data, uuid=f"{kind}-pixels-{i}") for i, data in enumerate(IMAGES)])
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    tolerance = 1e-2 if kind in ENGINE_DTYPE else 1e-5
    report: list[str] = []
    failures: list[str] = []
    for i, emb in enumerate(baseline["embeddings"]):
        own = runner.encoder_cache[f"{kind}-pixels-{i}"].float().cpu().numpy()
        assert own.shape == emb.shape, (i, own.shape, emb.shape)
        scale = float(np.abs(emb).max())
        diffs = [float(np.abs(a - b).max()) for a, b in zip(np.split(own, own.shape[1] // OUT_HIDDEN, axis=1),
                                                            np.split(emb, emb.shape[1] // OUT_HIDDEN, axis=1),
                                                            strict=True)]
        same = own_tokens[i] == baseline["connector"][i]
        report.append(
            f"{kind} image {i} {SIZES[i][0]}x{SIZES[i][1]} ({'as is' if i < UNRESIZED else 'resized'}): "
            f"{emb.shape[0]} x {emb.shape[1]}, max |diff| per block {' '.join(f'{d:.1e}' for d in diffs)} "
            f"(of max |x| {scale:.1f}), greedy tokens {'equal' if same else 'DIFFER'}"
        )
        if max(diffs) > tolerance * max(1.0, scale) or (kind not in ENGINE_DTYPE and not same):
            failures.append(report[-1])
    print("\n" + "\n".join(report))
    assert not failures, failures


PARITY_SIZES = [
    (32, 32), (64, 64), (64, 48), (100, 100), (111, 97), (150, 100), (256, 256), (257, 255), (300, 300),
    (640, 480), (480, 640), (1024, 64), (64, 1024), (333, 57), (57, 333), (800, 30), (30, 800), (999, 998),
    (13, 200), (200, 13), (1920, 1080), (77, 1500),
]


def test_token_parity_with_vllm_placeholders(llm: Any, server: ServerProcess) -> None:
    """/v1/tokens (count and image_grid_thw) == vLLM's placeholder count and its own smart_resize
    grid, over many sizes and aspect ratios."""
    from vllm import SamplingParams
    from vllm.model_executor.models.qwen2_vl import smart_resize

    hf = llm.llm_engine.model_config.hf_config
    requests = [pixels(png(w, h, seed=200 + i)) for i, (w, h) in enumerate(PARITY_SIZES)]
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    theirs = [o.prompt_token_ids.count(hf.image_token_id) for o in outputs]
    r = httpx.post(server.url + "/v1/tokens", json={"sizes": [list(s) for s in PARITY_SIZES]}, timeout=30)
    assert r.status_code == 200, r.text
    ours = [(i["num_tokens"], i["meta"]["image_grid_thw"]) for i in r.json()["items"]]
    vision = hf.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    mismatches = []
    for (w, h), (n, grid), count in zip(PARITY_SIZES, ours, theirs, strict=True):
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        if n != count or grid != [1, rh // vision.patch_size, rw // vision.patch_size]:
            mismatches.append(((w, h), n, grid, count))
    assert not mismatches, f"(size, encode-server N, grid, vLLM N): {mismatches}"


def test_the_family_is_published_for_the_proxy(kind: str, client: Client) -> None:
    model = client.model()
    assert model["kind"] == kind and model["hidden_size"] == _width(kind)
    assert model["family"]["name"] == "qwen3_vl"
    assert model["family"]["epd"]["mode"] == "pixel_free"
    assert model["family"]["epd"]["fields"]["image"] == ["image_grid_thw"]


def _video_metadata_only(meta: dict[str, Any], mm_hash: str) -> dict[str, Any]:
    import torch

    item = {"video_grid_thw": torch.tensor([meta["video_grid_thw"]]), "timestamps": [meta["timestamps"]]}
    uuids = {"video": [own_identifier(mm_hash, "video")]}  # a video's identifier: video:{mm_hash}
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": item}, "multi_modal_uuids": uuids}


def _video_direct(rows: np.ndarray, meta: dict[str, Any]) -> dict[str, Any]:
    import torch

    item = {"video_embeds": torch.tensor(rows), "video_grid_thw": torch.tensor([meta["video_grid_thw"]]),
            "timestamps": [meta["timestamps"]]}
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": item}}


def _vllm_loaded(data: bytes) -> tuple[Any, dict[str, Any]]:
    """The frames and metadata vLLM's own loader gives for the file (its OpenAI server's path)."""
    from vllm.multimodal.video import Qwen3VLVideoBackend

    return Qwen3VLVideoBackend.load_bytes(data)


def _video_plain(data: bytes, uuid: str) -> dict[str, Any]:
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": _vllm_loaded(data)},
            "multi_modal_uuids": {"video": [uuid]}}


@pytest.fixture(scope="module")
def video_baseline(llm: Any, server: ServerProcess, videos: list[bytes]) -> dict[str, Any]:
    counts_before = Counter(scheduler_connector(llm).counts)  # the image tests' (one wrong_shape on purpose)
    handed = [encode_video(server, v, "metadata") for v in videos]
    rows = [video_rows(encode_video(server, v, "embeddings")) for v in videos]
    metas = [h["meta"] for h in handed]
    hashes = [h["hash"] for h in handed]
    via_connector = greedy(llm, [_video_metadata_only(m, h) for m, h in zip(metas, hashes, strict=True)])
    direct = greedy(llm, [_video_direct(r, m) for r, m in zip(rows, metas, strict=True)])
    return {"metas": metas, "hashes": hashes, "rows": rows, "connector": via_connector, "direct": direct,
            "counts_before": counts_before}


def test_video_tokens_through_the_connector_equal_direct_video_embeds(llm: Any, video_baseline: dict[str, Any]) -> None:
    """The oracle: metadata-only video items (grid + timestamps, uuid = video:{mm_hash}) give the tokens the
    same rows given directly as video_embeds give; the connector served every video."""
    assert video_baseline["connector"] == video_baseline["direct"]
    counts = Counter(scheduler_connector(llm).counts)
    counts.subtract(video_baseline["counts_before"])  # since the video tests began, on this engine
    assert counts["hit"] >= len(VIDEOS) and counts["wrong_shape"] == 0, counts


def test_zeros_in_the_store_change_the_video_answer(
    llm: Any, server: ServerProcess, video_baseline: dict[str, Any], redis_proc: RedisProcess, videos: list[bytes]
) -> None:
    assert_zeros_change_the_answer(
        llm, server, redis_proc, PREFIX, video_baseline, videos, _video_metadata_only, _video_direct
    )


def test_video_rows_and_tokens_match_vllms_own_loader_and_tower(
    kind: str, llm: Any, videos: list[bytes], video_baseline: dict[str, Any]
) -> None:
    """vLLM's own path on the file (its loader samples, its processor resizes and patches, its tower
    encodes) gives encode-server's grid, timestamps and rows, every column (DeepStack blocks
    included), resized videos too: max |diff| <= TOLERANCE x max |x| (PyAV and OpenCV decode the
    H.264 stream with FFmpeg; the resize is torchvision's arithmetic in both). In float32, plain
    vLLM's greedy tokens equal the EPD request's; in bfloat16 they are printed (a bfloat16 tower's
    rows are not ours to the last bit, so a greedy token may flip)."""
    dtype = ENGINE_DTYPE.get(kind, "float32")
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    own_tokens = greedy(llm, [_video_plain(v, f"video-pixels-{i}") for i, v in enumerate(videos)])
    report = []
    for i, (data, meta, rows) in enumerate(zip(videos, video_baseline["metas"], video_baseline["rows"], strict=True)):
        _, vllm_meta = _vllm_loaded(data)
        own = runner.encoder_cache[f"video-pixels-{i}"].float().cpu().numpy()
        assert own.shape == rows.shape, (i, own.shape, rows.shape)
        blocks = own.shape[1] // OUT_HIDDEN
        diffs = [float(np.abs(a - b).max()) for a, b in zip(np.split(own, blocks, axis=1),
                                                            np.split(rows, blocks, axis=1), strict=True)]
        scale = float(np.abs(rows).max())
        same = own_tokens[i] == video_baseline["connector"][i]
        report.append(f"{kind} video {i} {VIDEOS[i]} ({'as is' if i < VIDEO_UNRESIZED else 'resized'}): vLLM sampled "
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
    outs = llm.generate([_video_plain(f, f"count-{i}") for i, f in enumerate(parity_files)],
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
