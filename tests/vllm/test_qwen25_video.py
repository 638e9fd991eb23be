"""Qwen2.5-VL videos through vLLM as an EC consumer, pixel-free (``video_grid_thw``, what vLLM 0.32's
Qwen2-VL parser declares): the oracle, the negative control, parity with vLLM's own loader (frame
sampling), processor and tower, token parity for several lengths, rates and sizes, and the one place
pixel-free cannot follow vLLM on the file: ``second_per_grid_ts``.

vLLM's side reads each file with the loader its OpenAI server picks for ``Qwen2VLVideoProcessor``
(``Qwen2VLVideoBackend.load_bytes``: OpenCV's FFmpeg, 2 fps, 4 to 768 frames in whole groups of two).
Qwen2.5-VL's M-RoPE scales a video's temporal positions by ``second_per_grid_ts * tokens_per_second``;
vLLM's processor computes ``second_per_grid_ts`` from the pixels, but its parser's embedding path
(``DictEmbeddingItems`` with the Qwen2-VL field factory) has no field for it and drops it, so a
pixel-free item always gets 1.0 s. The videos are chosen so that some sample to exactly 1.0 (the
tokens must equal vLLM on the file) and some do not (they must not, and vLLM's own rows given as
``video_embeds`` show it is the positions, not the rows).
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
from encode_client.keys import own_identifier

from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    PROMPT_HEAD,
    PROMPT_TAIL,
    connector_config,
    engine,
    greedy,
    model_runner,
    outcome,
    scheduler_connector,
    tiny_checkpoint,
)
from tests.vllm.epd_stack import video_files
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl
from tests.vllm.video_oracle import assert_zeros_change_the_answer, encode_video, video_rows

PREFIX = f"test-vllm-qwen25-video-{os.getpid()}"
PROMPT = PROMPT_HEAD + "<|vision_start|><|video_pad|><|vision_end|>" + PROMPT_TAIL
# (frames, fps, width, height). The first four sample to exactly 2 fps (second_per_grid_ts 1.0) at
# sizes the processor keeps (multiples of 28 within its pixel limits): 2 s of 4 frames, 2 s at 4 fps
# (4 of 8), 3 s at 4 fps (6 of 12), 5 s at 2 fps (all 10). Then 2.5 s (4 of 5 frames: 1.25 s per
# group), 3.5 s at 6 fps (6 of 21: 1.17 s), 6 s at 1 fps (all 6: 2.0 s), and two that are resized.
VIDEOS = [(4, 2.0, 56, 56), (8, 4.0, 84, 56), (12, 4.0, 112, 112), (10, 2.0, 56, 84),
          (5, 2.0, 56, 56), (21, 6.0, 56, 56), (6, 1.0, 56, 84), (30, 10.0, 96, 64), (12, 6.0, 100, 70)]
ONE_SECOND = 4  # VIDEOS[:4] sample to second_per_grid_ts == 1.0
UNRESIZED = 7  # VIDEOS[:7] are not resized by the processor


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("videos")
    return video_files(tmp, VIDEOS)


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_qwen2_5_vl, video={})


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def server(qwen25_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(qwen25_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
                        "--grpc-port", "0", "--max-batch-tokens", "64", "--dtype", "float32", log_dir=logs)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(qwen25_dir: Path, redis_proc: RedisProcess, server: ServerProcess) -> Iterator[Any]:
    config = connector_config(redis_proc.url, server.url, PREFIX, timeout_ms=500)
    with engine(qwen25_dir, config, limit_mm_per_prompt={"image": 1, "video": 1}, max_model_len=2048) as llm:
        yield llm


def _fields(meta: dict[str, Any], seconds: bool) -> dict[str, Any]:
    """The item's metadata: the grid (what the parser declares), and with ``seconds`` the
    ``second_per_grid_ts`` vLLM's processor would compute, as the tensor its field config takes."""
    import torch

    fields = {"video_grid_thw": torch.tensor([meta["video_grid_thw"]])}
    if seconds:
        fields["second_per_grid_ts"] = torch.tensor([meta["second_per_grid_ts"]])
    return fields


def _metadata_only(meta: dict[str, Any], mm_hash: str, *, seconds: bool = False) -> dict[str, Any]:
    """The EPD request for the video ``mm_hash``, named by its identifier (``video:{mm_hash}``)."""
    return {"prompt": PROMPT, "multi_modal_data": {"video": _fields(meta, seconds)},
            "multi_modal_uuids": {"video": [own_identifier(mm_hash, "video")]}}


def _direct(rows: np.ndarray, meta: dict[str, Any], *, seconds: bool = False) -> dict[str, Any]:
    import torch

    item = {"video_embeds": torch.tensor(rows), **_fields(meta, seconds)}
    return {"prompt": PROMPT, "multi_modal_data": {"video": item}}


def _vllm_loaded(data: bytes) -> tuple[Any, dict[str, Any]]:
    """The frames and metadata of the loader vLLM's OpenAI server picks for this checkpoint."""
    from vllm.multimodal.video import Qwen2VLVideoBackend, get_video_loader_backend_for_processor

    assert get_video_loader_backend_for_processor("Qwen2VLVideoProcessor") == "qwen2_vl"
    return Qwen2VLVideoBackend.load_bytes(data)


def _vllm_processed(llm: Any, data: bytes) -> dict[str, Any]:
    """vLLM's HF processor (as vLLM builds it from the checkpoint) on vLLM's loaded frames, called as
    vLLM's Qwen2.5-VL processor calls it (metadata without ``do_sample_frames``)."""
    from transformers.video_utils import VideoMetadata
    from vllm.multimodal import MULTIMODAL_REGISTRY

    frames, meta = _vllm_loaded(data)
    hf = MULTIMODAL_REGISTRY.create_processor(llm.llm_engine.model_config).info.get_hf_processor()
    metadata = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
    out = hf(text=PROMPT, videos=[frames], video_metadata=[metadata], return_tensors="pt")
    return {"video_grid_thw": out["video_grid_thw"][0].tolist(),
            "second_per_grid_ts": float(out["second_per_grid_ts"][0]), "frames": meta["frames_indices"]}


def _plain(data: bytes, uuid: str) -> dict[str, Any]:
    return {"prompt": PROMPT, "multi_modal_data": {"video": _vllm_loaded(data)}, "multi_modal_uuids": {"video": [uuid]}}


@pytest.fixture(scope="module")
def baseline(llm: Any, server: ServerProcess, videos: list[bytes]) -> dict[str, Any]:
    handed = [encode_video(server, v, "metadata") for v in videos]
    rows = [video_rows(encode_video(server, v, "embeddings")) for v in videos]
    metas = [h["meta"] for h in handed]
    hashes = [h["hash"] for h in handed]
    pairs = list(zip(metas, hashes, strict=True))
    via_connector = greedy(llm, [_metadata_only(m, h) for m, h in pairs])
    with_seconds = greedy(llm, [_metadata_only(m, h, seconds=True) for m, h in pairs])
    direct = greedy(llm, [_direct(r, m) for r, m in zip(rows, metas, strict=True)])
    direct_seconds = greedy(llm, [_direct(r, m, seconds=True) for r, m in zip(rows, metas, strict=True)])
    return {"metas": metas, "hashes": hashes, "rows": rows, "connector": via_connector, "direct": direct,
            "connector_seconds": with_seconds, "direct_seconds": direct_seconds}


def test_video_tokens_through_the_connector_equal_direct_video_embeds(llm: Any, baseline: dict[str, Any]) -> None:
    """The oracle: metadata-only video items (grid, uuid = video:{mm_hash}; with or without
    second_per_grid_ts) give the tokens the same rows given directly as video_embeds give; the
    connector served every video."""
    assert baseline["connector"] == baseline["direct"]
    assert baseline["connector_seconds"] == baseline["direct_seconds"]
    counts = scheduler_connector(llm).counts
    assert counts["hit"] >= 2 * len(VIDEOS) and counts["wrong_shape"] == 0, counts


def test_a_video_in_no_store_fails_alone_even_with_second_per_grid_ts(llm: Any, baseline: dict[str, Any]) -> None:
    """second_per_grid_ts is not a pixel: an item with it and the grid, whose uuid nothing holds,
    is failed as unavailable (the tower-free engine encodes nothing), then the engine answers."""
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    reason, tokens = outcome(llm, _metadata_only(baseline["metas"][4], "0" * 64, seconds=True))
    assert (reason, tokens) == ("error", [])
    after = connector.counts
    assert after["unavailable"] > before.get("unavailable", 0)
    assert after["local_fallback"] == before.get("local_fallback", 0)
    again = greedy(llm, [_metadata_only(baseline["metas"][4], baseline["hashes"][4], seconds=True)])
    assert again == [baseline["connector_seconds"][4]]


def test_vllms_chat_parser_takes_json_arrays_only_for_the_grid(llm: Any, baseline: dict[str, Any]) -> None:
    """Through vLLM's chat parser (its OpenAI server's), a video_embeds part takes JSON arrays only
    for the parser's metadata: second_per_grid_ts as numbers is refused, so the proxy sends it as a
    tensor string (tests/vllm/test_proxy_qwen25_video.py)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    fields = {"video_grid_thw": baseline["metas"][4]["video_grid_thw"], "second_per_grid_ts": [1.25]}
    part = {"type": "video_embeds", "video_embeds": fields, "uuid": baseline["hashes"][4]}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "describe the image"}]}]
    with pytest.raises(VLLMValidationError, match="JSON arrays are only supported for metadata: second_per_grid_ts"):
        llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)


def test_zeros_in_the_store_change_the_video_answer(
    llm: Any, server: ServerProcess, baseline: dict[str, Any], redis_proc: RedisProcess, videos: list[bytes]
) -> None:
    assert_zeros_change_the_answer(llm, server, redis_proc, PREFIX, baseline, videos, _metadata_only, _direct)


def test_video_rows_and_tokens_match_vllms_own_loader_and_tower(
    llm: Any, videos: list[bytes], baseline: dict[str, Any]
) -> None:
    """vLLM's own path on the file (its loader samples, its processor patches, its tower encodes)
    gives encode-server's frames, grid, second_per_grid_ts and rows: max |diff| <= 1e-5 x max |x|
    for every video, resized ones included (PyAV and OpenCV decode the same H.264 stream with
    FFmpeg; the server resizes frames with the torch operations of vLLM's torchvision-based video
    processor, so its model inputs are the processor's bit for bit).

    Greedy tokens: the EPD request with ``second_per_grid_ts`` equals plain vLLM on the file. With
    the grid alone (what the parser declares) it equals plain vLLM exactly when vLLM's processor
    gives 1.0 s per group (vLLM's default when the field is absent) and differs otherwise; vLLM's
    *own* rows given as video_embeds without the field give those same EPD tokens: the temporal
    positions differ, not the rows."""
    own_tokens = greedy(llm, [_plain(v, f"video-pixels-{i}") for i, v in enumerate(videos)])
    cache = model_runner(llm).encoder_cache
    own_rows = [cache[f"video-pixels-{i}"].float().cpu().numpy() for i in range(len(videos))]
    own_as_embeds = greedy(llm, [_direct(own, meta) for own, meta in zip(own_rows, baseline["metas"], strict=True)])
    report = []
    for i, (data, meta, rows, own) in enumerate(zip(videos, baseline["metas"], baseline["rows"], own_rows,
                                                   strict=True)):
        theirs = _vllm_processed(llm, data)
        assert meta["video_grid_thw"] == theirs["video_grid_thw"], (i, meta, theirs)
        assert meta["second_per_grid_ts"] == pytest.approx(theirs["second_per_grid_ts"], rel=1e-6), (i, meta, theirs)
        assert own.shape == rows.shape, (i, own.shape, rows.shape)
        diff, scale = float(np.abs(own - rows).max()), float(np.abs(rows).max())
        grid_only = own_tokens[i] == baseline["connector"][i]
        with_seconds = own_tokens[i] == baseline["connector_seconds"][i]
        report.append(f"video {i} {VIDEOS[i]}: vLLM sampled frames {theirs['frames']}, grid {meta['video_grid_thw']}, "
                      f"second_per_grid_ts {meta['second_per_grid_ts']:g}; max |diff| {diff:.1e} (of {scale:.1f}); "
                      f"greedy vs plain vLLM: grid only {'equal' if grid_only else 'DIFFER'}, "
                      f"with second_per_grid_ts {'equal' if with_seconds else 'DIFFER'}")
        assert diff <= 1e-5 * max(1.0, scale), report[-1]
        assert with_seconds, report[-1]
        if i < ONE_SECOND:
            assert meta["second_per_grid_ts"] == 1.0 and grid_only, report[-1]
        elif i < UNRESIZED:
            assert meta["second_per_grid_ts"] != 1.0 and not grid_only, report[-1]
            assert own_as_embeds[i] == baseline["connector"][i], report[-1]
    print("\n" + "\n".join(report))


def test_video_token_parity_with_vllm_placeholders(llm: Any, server: ServerProcess, tmp_path: Path) -> None:
    """/v1/tokens for a video, from its header alone, == vLLM's placeholder count (video pads), the
    frames its loader samples, and the grid and second_per_grid_ts its processor computes, over
    lengths, rates, sizes and containers."""
    from vllm import SamplingParams

    specs = [(4, 2.0, 64, 64), (7, 3.0, 64, 96), (25, 25.0, 160, 90), (3, 1.0, 320, 240), (48, 24.0, 64, 64),
             (60, 30.0, 200, 100), (9, 2.0, 34, 258), (11, 2.0, 28, 28), (90, 30.0, 56, 56)]
    files = video_files(tmp_path, [*specs, (10, 5.0, 96, 64, "libvpx-vp9")])
    body = {"items": [{"data": base64.b64encode(f).decode(), "modality": "video"} for f in files]}
    r = httpx.post(server.url + "/v1/tokens", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ours = r.json()["items"]
    video_token = llm.llm_engine.model_config.hf_config.video_token_id
    outs = llm.generate([_plain(f, f"count-{i}") for i, f in enumerate(files)],
                        SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    theirs = [o.prompt_token_ids.count(video_token) for o in outs]
    assert [o["num_tokens"] for o in ours] == theirs, (ours, theirs)
    for f, mine in zip(files, ours, strict=True):
        processed = _vllm_processed(llm, f)
        assert mine["meta"]["video_grid_thw"] == processed["video_grid_thw"], (mine, processed)
        assert mine["meta"]["second_per_grid_ts"] == pytest.approx(processed["second_per_grid_ts"], rel=1e-6)
    print(f"\n{len(files)} videos: placeholder counts {theirs} equal /v1/tokens'")
