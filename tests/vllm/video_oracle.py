"""What the video oracles through vLLM share (test_qwen3_vl, test_qwen25_video,
test_tower_free_qwen3): encode-server's answer for a video and its rows, and the negative control
(zeros stored under the videos' keys change the answer). Test videos: ``epd_stack.video_file``."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
from encode_client.keys import store_key

from tests.redis_procs import RedisProcess
from tests.server import ServerProcess
from tests.vllm.conftest import greedy, stored_value

__all__ = ["assert_zeros_change_the_answer", "encode_video", "video_rows"]


def encode_video(server: ServerProcess, data: bytes, ret: str) -> dict[str, Any]:
    """encode-server's answer item for one video (``ret``: ``"metadata"`` or ``"embeddings"``)."""
    body = {"items": [{"data": base64.b64encode(data).decode(), "modality": "video"}], "return": ret}
    r = httpx.post(server.url + "/v1/encode", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json()["items"][0])


def video_rows(item: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(item["shape"]).copy()


def assert_zeros_change_the_answer(
    llm: Any, server: ServerProcess, redis_proc: RedisProcess, prefix: str, baseline: dict[str, Any],
    videos: Sequence[bytes], metadata_only: Callable[[dict[str, Any], str], dict[str, Any]],
    direct: Callable[[np.ndarray, dict[str, Any]], dict[str, Any]],
) -> None:
    """Zeros stored under every video's key: the connector's tokens are those of zeros given
    directly, and differ from each video's own; the real values are put back after."""
    fingerprint = httpx.get(server.url + "/v1/model").json()["fingerprint"]
    redis = redis_proc.client()
    for h, meta, rows in zip(baseline["hashes"], baseline["metas"], baseline["rows"], strict=True):
        zeros = stored_value(np.zeros_like(rows), fingerprint, h, meta)
        redis.set(store_key(fingerprint, h, prefix=prefix, modality="video"), zeros)
    llm.llm_engine.reset_encoder_cache()
    zeros = greedy(llm, [metadata_only(m, h) for m, h in zip(baseline["metas"], baseline["hashes"], strict=True)])
    assert zeros == greedy(llm, [direct(np.zeros_like(r), m) for r, m in zip(baseline["rows"], baseline["metas"],
                                                                            strict=True)])
    for i, (zero, real) in enumerate(zip(zeros, baseline["connector"], strict=True)):
        assert zero != real, f"video {i}: zeros gave the same tokens as its embedding"
    for v in videos:
        encode_video(server, v, "metadata")  # the real values back
