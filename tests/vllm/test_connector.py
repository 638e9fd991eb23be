"""vLLM, as an EC consumer with ``EncodeServerECConnector``, takes its image embeddings from
encode-server's Redis tier: the oracle, the negative control, parity with vLLM's own vision tower
and placeholder counts, and the faults.

One engine for the module, on its own redis-server (the fault tests kill it), and one
encode-server on the same checkpoint directory.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from encode_client import Client
from encode_client.keys import store_key

from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    connector_config,
    direct_embeds,
    engine,
    greedy,
    metadata_only,
    metric,
    outcome,
    pixels,
    png,
    scheduler_connector,
    stored_value,
)
from tests.vllm.tiny_qwen import MAX_PIXELS, MIN_PIXELS

PREFIX = "test-vllm-connector"
# width x height. The first three are multiples of 28 within [min_pixels, max_pixels]: the
# processor does not resize them. The others are resized (down to max_pixels, or to a multiple of 28).
SIZES = [(56, 56), (112, 84), (224, 168), (150, 100), (300, 260), (400, 60)]
UNRESIZED = 3
IMAGES = [png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def server(model_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(model_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
        "--grpc-port", "0", "--redis-timeout-ms", "300", log_dir=logs,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, response="json", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir: Path, redis_proc: RedisProcess, server: ServerProcess) -> Iterator[Any]:
    config = connector_config(redis_proc.url, server.url, PREFIX, timeout_ms=300, down_for_s=1.0)
    with engine(model_dir, config) as llm:
        print(f"\nvLLM engine (EC consumer) started in {llm.startup_seconds:.1f} s")
        yield llm


@pytest.fixture(scope="module")
def fingerprint(client: Client) -> str:
    return str(client.model()["fingerprint"])


@pytest.fixture(scope="module")
def baseline(llm: Any, client: Client) -> dict[str, Any]:
    """Hand every image off to encode-server, then the greedy tokens of the EPD request
    (metadata only, uuid = mm_hash) and of the same embeddings given directly."""
    results = client.hand_off(IMAGES)
    grids = [r.meta["image_grid_thw"] for r in results]
    hashes = [r.hash for r in results]
    embeddings = [r.numpy() for r in client.encode(IMAGES)]
    started = time.perf_counter()
    via_connector = greedy(llm, [metadata_only(g, h) for g, h in zip(grids, hashes, strict=True)])
    seconds = time.perf_counter() - started
    direct = greedy(llm, [direct_embeds(e, g) for e, g in zip(embeddings, grids, strict=True)])
    print(f"\n{len(IMAGES)} EPD requests (metadata only) in one batch: {seconds * 1000:.0f} ms")
    return {"grids": grids, "hashes": hashes, "embeddings": embeddings, "connector": via_connector, "direct": direct}


def _worker_counts() -> dict[str, int]:
    from vllm.distributed.ec_transfer import get_ec_transfer

    return dict(get_ec_transfer().counts)


def test_consumer_tokens_equal_direct_image_embeds(llm: Any, baseline: dict[str, Any]) -> None:
    """The oracle: greedy tokens through the connector == greedy tokens with the same embedding
    given to vLLM directly; and the connector really served them (counts), with no pixels."""
    assert baseline["connector"] == baseline["direct"]
    counts = scheduler_connector(llm).counts
    assert counts["hit"] >= len(IMAGES), counts
    assert _worker_counts()["loaded"] >= len(IMAGES)


def test_zeros_in_the_store_change_the_answer(
    llm: Any, client: Client, baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str
) -> None:
    """The negative control: replace each stored embedding by zeros of the same shape; the EPD
    request's tokens become those of zeros given directly, and differ from the real ones."""
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
    client.hand_off(IMAGES)  # the server writes its (local-tier) embeddings back over the zeros
    llm.llm_engine.reset_encoder_cache()
    assert greedy(llm, [metadata_only(g, h) for g, h in zip(baseline["grids"], baseline["hashes"], strict=True)]) == (
        baseline["connector"]
    )


def test_embedding_and_tokens_match_vllms_own_vision_tower(llm: Any, baseline: dict[str, Any]) -> None:
    """encode-server's embedding == vLLM's own vision tower output for the same image, and plain
    vLLM on the pixels gives the tokens the EPD request gives.

    Exact up to float32 noise (max |diff| <= 1e-5 x the largest magnitude) for images the processor
    does not resize. A resized image differs more, by the resize alone: encode-server's venv has no
    torchvision, so transformers gives it the PIL image processor, while vLLM's (with torchvision)
    gets the torchvision one; their bicubic resizes round differently (transformers fingerprints
    the processor class for this reason). Those are measured and printed, not asserted equal.
    """
    own_tokens = greedy(llm, [pixels(data, uuid=f"pixels-{i}") for i, data in enumerate(IMAGES)])
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    report = []
    for i, emb in enumerate(baseline["embeddings"]):
        own = runner.encoder_cache[f"pixels-{i}"].float().cpu().numpy()
        assert own.shape == emb.shape, (i, own.shape, emb.shape)
        diff = float(np.abs(own - emb).max())
        scale = float(np.abs(emb).max())
        same = own_tokens[i] == baseline["connector"][i]
        kind = "as is" if i < UNRESIZED else "resized"
        report.append(
            f"image {i} {SIZES[i][0]}x{SIZES[i][1]} ({kind}): {emb.shape[0]} tokens, max |diff| {diff:.1e} "
            f"(of max |x| {scale:.1f}), greedy tokens {'equal' if same else 'DIFFER'}"
        )
        if i < UNRESIZED:
            assert diff <= 1e-5 * max(1.0, scale), report[-1]
            assert same, report[-1]
    print("\n" + "\n".join(report))


# Sizes across aspect ratios and scales, inside and outside [min_pixels, max_pixels].
PARITY_SIZES = [
    (28, 28), (56, 56), (64, 48), (100, 100), (111, 97), (150, 100), (224, 224), (225, 223), (300, 300),
    (640, 480), (480, 640), (1024, 64), (64, 1024), (333, 57), (57, 333), (800, 30), (30, 800), (999, 998),
    (13, 200), (200, 13), (1920, 1080), (77, 1500),
]


def _vllm_placeholders(llm: Any, sizes: list[tuple[int, int]], **kwargs: Any) -> list[int]:
    """vLLM's own placeholder count per image: the image tokens in the engine's prompt."""
    from vllm import SamplingParams

    image_token = llm.llm_engine.model_config.hf_config.image_token_id
    requests = []
    for i, (w, h) in enumerate(sizes):
        request = pixels(png(w, h, seed=100 + i))
        if kwargs:
            request["mm_processor_kwargs"] = kwargs
        requests.append(request)
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [o.prompt_token_ids.count(image_token) for o in outputs]


def _server_tokens(url: str, sizes: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    r = httpx.post(url + "/v1/tokens", json={"sizes": [list(s) for s in sizes]}, timeout=30)
    assert r.status_code == 200, r.text
    return [(i["num_tokens"], i["meta"]["image_grid_thw"]) for i in r.json()["items"]]


def _vllm_grid(llm: Any, width: int, height: int, **kwargs: Any) -> list[int]:
    """vLLM's Qwen2-VL resize rule (its own smart_resize call) for one size."""
    from vllm.model_executor.models.qwen2_vl import smart_resize

    vision = llm.llm_engine.model_config.hf_config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    h, w = smart_resize(
        height, width, factor=factor, min_pixels=kwargs.get("min_pixels", MIN_PIXELS),
        max_pixels=kwargs.get("max_pixels", MAX_PIXELS),
    )
    return [1, h // vision.patch_size, w // vision.patch_size]


WIDER = {"min_pixels": 112 * 112, "max_pixels": 448 * 448}


@pytest.mark.parametrize("settings", [{}, WIDER], ids=["checkpoint", "wider"])
def test_token_parity_with_vllm_placeholders(
    llm: Any, model_dir: Path, server: ServerProcess, logs: Path, tmp_path: Path, settings: dict[str, int]
) -> None:
    """encode-server's /v1/tokens (count and image_grid_thw) == vLLM's placeholder count for the
    same checkpoint and processor settings, over many sizes and aspect ratios. "wider": a second
    server on a copy of the checkpoint whose preprocessor_config.json has other min/max pixels, and
    vLLM with the same values as mm_processor_kwargs."""
    url, other = server.url, None
    if settings:
        copy = tmp_path / "model"
        shutil.copytree(model_dir, copy)
        config = json.loads((copy / "preprocessor_config.json").read_text())
        config["size"] = {"shortest_edge": settings["min_pixels"], "longest_edge": settings["max_pixels"]}
        config.update(settings)
        (copy / "preprocessor_config.json").write_text(json.dumps(config))
        other = start_server("--model", str(copy), "--grpc-port", "0", log_dir=logs)
        url = other.url
    try:
        ours = _server_tokens(url, PARITY_SIZES)
        theirs = _vllm_placeholders(llm, PARITY_SIZES, **settings)
    finally:
        if other is not None:
            other.stop()
    mismatches = [
        (size, mine, count, _vllm_grid(llm, *size, **settings))
        for size, mine, count in zip(PARITY_SIZES, ours, theirs, strict=True)
        if mine[0] != count or mine[1] != _vllm_grid(llm, *size, **settings)
    ]
    assert not mismatches, f"(size, encode-server (N, grid), vLLM N, vLLM grid): {mismatches}"


# -- faults: each gives a correct answer (vLLM encodes itself) or a clear error; never a hang --


def _fault_case(llm: Any, baseline: dict[str, Any], index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pixels request with uuid = mm_hash (vLLM can encode it itself) and the metadata-only one."""
    h, grid = baseline["hashes"][index], baseline["grids"][index]
    return pixels(IMAGES[index], uuid=h), metadata_only(grid, h)


def _check_fallback(llm: Any, baseline: dict[str, Any], index: int, counter: str) -> None:
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    with_pixels, without = _fault_case(llm, baseline, index)
    llm.llm_engine.reset_encoder_cache()
    started = time.perf_counter()
    assert greedy(llm, [with_pixels]) == [baseline["connector"][index]], "vLLM's own encode gave other tokens"
    llm.llm_engine.reset_encoder_cache()
    reason, tokens = outcome(llm, without)
    assert reason == "error" and tokens == [], (reason, tokens)
    assert time.perf_counter() - started < 60
    after = connector.counts
    assert after[counter] > before.get(counter, 0), (counter, before, dict(after))
    assert after["local_fallback"] > before.get("local_fallback", 0)
    assert after["unavailable"] > before.get("unavailable", 0)


def test_fault_value_evicted(llm: Any, baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str) -> None:
    h = baseline["hashes"][0]
    assert redis_proc.client().delete(store_key(fingerprint, h, prefix=PREFIX)) == 1
    _check_fallback(llm, baseline, 0, "absent")


def test_fault_corrupt_value(llm: Any, baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str) -> None:
    key = store_key(fingerprint, baseline["hashes"][1], prefix=PREFIX)
    blob = redis_proc.client().get(key)
    assert blob is not None
    redis_proc.client().set(key, blob[: len(blob) // 2])  # a truncated write
    _check_fallback(llm, baseline, 1, "corrupt")


def test_fault_wrong_row_count(
    llm: Any, baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str
) -> None:
    """A well-formed value with one row too many: vLLM would not notice; the connector does."""
    h, grid, emb = baseline["hashes"][2], baseline["grids"][2], baseline["embeddings"][2]
    longer = np.concatenate([emb, emb[:1]])
    redis_proc.client().set(
        store_key(fingerprint, h, prefix=PREFIX), stored_value(longer, fingerprint, h, {"image_grid_thw": grid})
    )
    _check_fallback(llm, baseline, 2, "wrong_shape")


def test_fault_redis_down_then_back(
    llm: Any, client: Client, baseline: dict[str, Any], redis_proc: RedisProcess, server: ServerProcess
) -> None:
    """Redis killed: requests with pixels are answered by vLLM's own encoder, metadata-only ones
    fail fast with an error; Redis back (same port): the EPD path works again."""
    redis_proc.kill()
    try:
        _check_fallback(llm, baseline, 3, "redis_error")
    finally:
        redis_proc.start()
    client.hand_off(IMAGES)  # refill the new, empty Redis from the server's local tier
    time.sleep(1.2)  # the connector's down_for_s
    llm.llm_engine.reset_encoder_cache()
    requests = [metadata_only(g, h) for g, h in zip(baseline["grids"], baseline["hashes"], strict=True)]
    assert greedy(llm, requests) == baseline["connector"]
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "encode_server_items_total", status="encoded") >= len(IMAGES)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, "needs redis_url"),
        ({"redis_url": "redis://127.0.0.1:1/0"}, "needs fingerprint or encoder_url"),
        ({"redis_url": "redis://x", "fingerprint": "ab" * 32, "prefx": "typo"}, "unknown keys"),
        ({"redis_url": "redis://x", "fingerprint": "ab" * 32, "timeout_ms": 0}, "timeout_ms"),
        # One connector for one tenant let plain identifiers read that tenant's keys; identifiers
        # now name their tenant (issue 18), so the setting is refused rather than half-honoured.
        ({"redis_url": "redis://x", "fingerprint": "ab" * 32, "tenant": "acme"}, "'tenant' is gone"),
    ],
)
def test_connector_settings_are_checked_at_start(extra: dict[str, Any], words: str) -> None:
    from encode_client.vllm_connector import ConnectorSettings

    with pytest.raises(ValueError, match=words):
        ConnectorSettings.from_extra(extra)
