"""Qwen3-VL-family prefill workers without their vision tower (every image and video limit 0), as
vLLM 0.32 builds them.

Qwen3-VL and Qwen3-VL-MoE: vLLM turns DeepStack off when it builds no tower, so the wide rows an E
hands it would kill the engine at the first request (a shape mismatch, ``EngineDeadError``); the
connector refuses such an engine at start, with an error naming the fix. Qwen3.5 has no DeepStack
(its rows are the language model's width): it starts tower-free, and its metadata-only images and
videos answer as the same rows given to it directly, and as an engine with its tower answers them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from encode_client import Client

from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    REDIS_URL,
    connector_config,
    direct_embeds,
    engine,
    greedy,
    metadata_only,
    png,
    scheduler_connector,
    tiny_checkpoint,
    tower_parameters,
)
from tests.vllm.epd_stack import video_file
from tests.vllm.test_qwen3_vl import _video_direct, _video_metadata_only
from tests.vllm.tiny_qwen3 import make_tiny_qwen3
from tests.vllm.video_oracle import encode_video, video_rows

PREFIX = f"test-vllm-tower-free-qwen3-{os.getpid()}"
IMAGES = [png(64, 64, seed=70), png(96, 64, seed=71)]  # multiples of 32 within the pixel limits
# Any fingerprint: the refusal comes before the connector reads anything.
UNREAD = {"ec_connector": "EncodeServerECConnector", "ec_connector_module_path": "encode_client.vllm_connector",
          "ec_role": "ec_consumer", "ec_connector_extra_config": {"redis_url": REDIS_URL, "fingerprint": "0" * 64}}


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_vl_moe"])
def test_a_tower_free_deepstack_engine_is_refused_at_start_naming_the_fix(
    kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = tiny_checkpoint(tmp_path_factory, make_tiny_qwen3, kind=kind)
    with pytest.raises(Exception) as info, engine(model, UNREAD):  # vLLM may wrap it: the message counts
        pass
    chain: list[str] = []
    error: BaseException | None = info.value
    while error is not None:
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    text = "\n".join(chain)
    assert "packs 2 DeepStack levels" in text and "Give the model its tower" in text, text
    assert "--limit-mm-per-prompt" in text and "EngineDead" not in text, text


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_qwen3, kind="qwen3_5")


@pytest.fixture(scope="module")
def server(qwen35_dir: Path, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--model", str(qwen35_dir), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX,
                        "--grpc-port", "0", "--dtype", "float32", log_dir=logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


def test_qwen3_5_runs_tower_free(
    qwen35_dir: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No DeepStack: the engine starts without its tower (no vision parameter), the connector
    serves every metadata-only image and video, and the tokens equal the same rows given as
    image_embeds / video_embeds, and an engine with its tower's on the same requests."""
    with Client(server.url, response="json", timeout=60) as client:
        results = client.hand_off(IMAGES)
        embeddings = [r.numpy() for r in client.encode(IMAGES)]
    grids = [r.meta["image_grid_thw"] for r in results]
    video = video_file(tmp_path_factory.mktemp("tower_free_video"), 5, 2.0, 64, 64)
    handed, rows = encode_video(server, video, "metadata"), video_rows(encode_video(server, video, "embeddings"))
    epd = [*(metadata_only(g, r.hash) for g, r in zip(grids, results, strict=True)),
           _video_metadata_only(handed["meta"], handed["hash"])]
    direct = [*(direct_embeds(e, g) for e, g in zip(embeddings, grids, strict=True)),
              _video_direct(rows, handed["meta"])]
    config = connector_config(REDIS_URL, server.url, PREFIX, timeout_ms=500)
    answers = {}
    # Its text model needs bfloat16 on vLLM's CPU build.
    for tower, limits in ((False, {"image": 0, "video": 0}), (True, {"image": 1, "video": 1})):
        with engine(qwen35_dir, config, dtype="bfloat16", limit_mm_per_prompt=limits, max_model_len=2048) as llm:
            print(f"\nqwen3_5 engine ({'with its tower' if tower else 'tower-free'}) started in "
                  f"{llm.startup_seconds:.1f} s")
            assert (tower_parameters(llm) > 0) == tower
            answers[tower] = greedy(llm, epd)
            if not tower:
                assert answers[tower] == greedy(llm, direct)
            counts = dict(scheduler_connector(llm).counts)
            assert counts.get("hit", 0) >= len(epd) and counts.get("unavailable", 0) == 0, counts
    assert answers[False] == answers[True]
