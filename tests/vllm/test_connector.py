"""vLLM as the documented EPD prefill: a tower-free EC consumer (every modality's limit 0, so vLLM
builds no vision tower) with ``EncodeServerECConnector``, taking its image embeddings from
encode-server's Redis tier: the oracle, the negative control, pixels refused, and the faults,
where a tower-free engine has no encoder of its own to fall back to.

One engine for the module, on its own redis-server (the fault tests kill it), and one
encode-server on the same checkpoint directory. The tests that need vLLM to see pixels (its own
tower, its placeholder counts) are in test_connector_with_tower.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    epd_baseline,
    greedy,
    metadata_only,
    outcome,
    pixels,
    png,
    scheduler_connector,
    stored_value,
    tower_parameters,
)

PREFIX = f"test-vllm-connector-{os.getpid()}"
# width x height: unresized multiples of 28 and sizes the processor resizes.
SIZES = [(56, 56), (112, 84), (224, 168), (150, 100), (300, 260), (400, 60)]
IMAGES = [png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    with start_redis() as proc:
        yield proc


@pytest.fixture(scope="module")
def server(model_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(model_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
        "--grpc-port", "0", "--redis-timeout-ms", "300", "--dtype", "float32", log_dir=logs,
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
        print(f"\nvLLM engine (tower-free EC consumer) started in {llm.startup_seconds:.1f} s")
        yield llm


@pytest.fixture(scope="module")
def fingerprint(client: Client) -> str:
    return str(client.model()["fingerprint"])


@pytest.fixture(scope="module")
def baseline(llm: Any, client: Client) -> dict[str, Any]:
    return epd_baseline(llm, client, IMAGES)


def _worker_counts() -> dict[str, int]:
    from vllm.distributed.ec_transfer import get_ec_transfer

    return dict(get_ec_transfer().counts)


def test_the_consumer_holds_no_vision_tower(llm: Any) -> None:
    """vLLM skipped the tower (its modules are placeholders that hold no weights)."""
    assert tower_parameters(llm) == 0
    from vllm.model_executor.models.utils import StageMissingLayer

    from tests.vllm.conftest import model_runner

    assert isinstance(model_runner(llm).get_model().visual, StageMissingLayer)


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


def test_pixels_are_refused_and_the_engine_serves_on(llm: Any, baseline: dict[str, Any]) -> None:
    """A tower-free engine takes no pixels: vLLM refuses the request before it is scheduled."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"At most 0 image\(s\)"):
        greedy(llm, [pixels(IMAGES[0])])
    llm.llm_engine.reset_encoder_cache()
    assert greedy(llm, [metadata_only(baseline["grids"][0], baseline["hashes"][0])]) == [baseline["connector"][0]]


# -- faults. An image handed off through ``server`` is still in its local tier when Redis has no
# valid value: the connector fetches it from there, and the answer is unchanged. One handed off
# through ``lone`` (no local tier) is nowhere else: the request fails cleanly, and the engine then
# serves the next request. A tower-free engine has no encoder of its own to fall back to.


@pytest.fixture(scope="module")
def lone(model_dir: Path, redis_proc: RedisProcess, logs: Path) -> Iterator[ServerProcess]:
    """A second encode-server on the same Redis and prefix, without a local tier (--cache-mb 0)."""
    proc = start_server(
        "--model", str(model_dir), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
        "--grpc-port", "0", "--redis-timeout-ms", "300", "--dtype", "float32", "--cache-mb", "0", log_dir=logs,
    )
    yield proc
    proc.stop()


LONE_IMAGES = [png(w, h, seed=100 + i) for i, (w, h) in enumerate(SIZES[:4])]


@pytest.fixture(scope="module")
def lone_baseline(llm: Any, lone: ServerProcess) -> dict[str, Any]:
    with Client(lone.url, response="json", timeout=60) as c:
        return epd_baseline(llm, c, LONE_IMAGES)


def _served(llm: Any, baseline: dict[str, Any], index: int) -> list[int]:
    llm.llm_engine.reset_encoder_cache()
    return greedy(llm, [metadata_only(baseline["grids"][index], baseline["hashes"][index])])[0]


def _check_from_the_encoder(llm: Any, baseline: dict[str, Any], index: int, counter: str) -> None:
    """Redis has no valid value for image ``index`` (``counter`` says why); the connector fetched
    it from encode-server's local tier, and the tokens are the EPD answer (== direct embeds)."""
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    assert _served(llm, baseline, index) == baseline["connector"][index] == baseline["direct"][index]
    after = connector.counts
    assert after[counter] > before.get(counter, 0), (counter, before, dict(after))
    assert after["from_encoder"] == before.get("from_encoder", 0) + 1, (before, dict(after))
    assert after["unavailable"] == before.get("unavailable", 0)


def _check_failed_then_served(llm: Any, baseline: dict[str, Any], index: int, counter: str, then: Any) -> None:
    """Image ``index`` is valid nowhere: its metadata-only request ends with an error (no tokens,
    no hang), the connector counted why, and the engine then answers ``then`` correctly."""
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    h, grid = baseline["hashes"][index], baseline["grids"][index]
    llm.llm_engine.reset_encoder_cache()
    started = time.perf_counter()
    reason, tokens = outcome(llm, metadata_only(grid, h))
    assert reason == "error" and tokens == [], (reason, tokens)
    assert time.perf_counter() - started < 60
    after = connector.counts
    assert after[counter] > before.get(counter, 0), (counter, before, dict(after))
    asked = ("encoder_absent", "encoder_corrupt", "encoder_wrong_shape")
    assert sum(after[c] - before.get(c, 0) for c in asked) == 1, "encode-server was asked, with no valid value"
    assert after["unavailable"] > before.get("unavailable", 0)
    assert after["local_fallback"] == before.get("local_fallback", 0), "a tower-free engine encodes nothing"
    then()


def _both(
    llm: Any, baseline: dict[str, Any], lone_baseline: dict[str, Any], index: int, counter: str, spoil: Any
) -> None:
    """``spoil(baseline, index)`` the Redis value of an image the server holds and of one it does
    not; the first is served from the server, the second fails and the engine serves the first."""
    spoil(baseline, index)
    spoil(lone_baseline, index)
    _check_from_the_encoder(llm, baseline, index, counter)
    _check_failed_then_served(
        llm, lone_baseline, index, counter,
        lambda: _check_from_the_encoder(llm, baseline, index, counter),
    )


def test_fault_value_evicted(
    llm: Any, baseline: dict[str, Any], lone_baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str
) -> None:
    """The issue's case: the embedding deleted from Redis, still in encode-server's local tier."""

    def evict(b: dict[str, Any], i: int) -> None:
        redis_proc.client().delete(store_key(fingerprint, b["hashes"][i], prefix=PREFIX))

    _both(llm, baseline, lone_baseline, 0, "absent", evict)


def test_fault_corrupt_value(
    llm: Any, baseline: dict[str, Any], lone_baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str
) -> None:
    def truncate(b: dict[str, Any], i: int) -> None:
        key = store_key(fingerprint, b["hashes"][i], prefix=PREFIX)
        blob = redis_proc.client().get(key)
        redis_proc.client().set(key, (blob or b"x")[: len(blob or b"x") // 2])  # a truncated write

    _both(llm, baseline, lone_baseline, 1, "corrupt", truncate)


def test_fault_wrong_row_count(
    llm: Any, baseline: dict[str, Any], lone_baseline: dict[str, Any], redis_proc: RedisProcess, fingerprint: str
) -> None:
    """A well-formed value with one row too many: vLLM would not notice; the connector does."""

    def longer(b: dict[str, Any], i: int) -> None:
        h, grid, emb = b["hashes"][i], b["grids"][i], b["embeddings"][i]
        value = stored_value(np.concatenate([emb, emb[:1]]), fingerprint, h, {"image_grid_thw": grid})
        redis_proc.client().set(store_key(fingerprint, h, prefix=PREFIX), value)

    _both(llm, baseline, lone_baseline, 2, "wrong_shape", longer)


def test_fault_redis_down_then_back(
    llm: Any, client: Client, baseline: dict[str, Any], lone_baseline: dict[str, Any], redis_proc: RedisProcess
) -> None:
    """Redis killed: images encode-server holds are served from it, the others fail fast with an
    error; Redis back (same port): the EPD path works again, for every image."""
    redis_proc.kill()
    try:
        _check_from_the_encoder(llm, baseline, 3, "redis_error")
        _check_failed_then_served(
            llm, lone_baseline, 3, "redis_error", lambda: _check_from_the_encoder(llm, baseline, 4, "redis_error")
        )
    finally:
        redis_proc.start()
    client.hand_off(IMAGES)  # refill the new, empty Redis from the server's local tier
    time.sleep(1.2)  # the connector's down_for_s
    connector = scheduler_connector(llm)
    before = connector.counts["from_redis"]
    llm.llm_engine.reset_encoder_cache()
    requests = [metadata_only(g, h) for g, h in zip(baseline["grids"], baseline["hashes"], strict=True)]
    assert greedy(llm, requests) == baseline["connector"]
    assert connector.counts["from_redis"] == before + len(IMAGES)


def test_without_the_fallback_a_value_redis_lost_fails_the_request(
    model_dir: Path, redis_proc: RedisProcess, server: ServerProcess, baseline: dict[str, Any], fingerprint: str,
    llm: Any,
) -> None:
    """``encoder_fallback: false`` is the connector before this fallback: the same eviction fails
    the request although encode-server holds the image (the issue's 500), which the tests above
    would show if the fallback did nothing."""
    from encode_client.vllm_connector import ConnectorSettings

    extra = connector_config(redis_proc.url, server.url, PREFIX, encoder_fallback=False)["ec_connector_extra_config"]
    assert ConnectorSettings.from_extra(extra).encoder_fallback is False
    connector = scheduler_connector(llm)
    connector.settings, kept = ConnectorSettings.from_extra(extra), connector.settings
    try:
        redis_proc.client().delete(store_key(fingerprint, baseline["hashes"][5], prefix=PREFIX))
        llm.llm_engine.reset_encoder_cache()
        reason, _ = outcome(llm, metadata_only(baseline["grids"][5], baseline["hashes"][5]))
        assert reason == "error"
    finally:
        connector.settings = kept
    assert _served(llm, baseline, 5) == baseline["connector"][5], "with the fallback: served"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, "needs redis_url"),
        ({"redis_url": "redis://x", "encoder_url": ["http://a:1", "ftp://b"]}, "encoder_url must be"),
        ({"redis_url": "redis://x", "fingerprint": "ab" * 32, "encoder_timeout_ms": 0}, "encoder_timeout_ms"),
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


def test_local_input_is_told_by_what_an_items_fields_hold_not_their_names() -> None:
    """Pixels and embeddings are arrays of two or more dimensions (or lists of them); what sizes or
    places an item (a grid, a patch count, a temporal scale) is a scalar or a vector. So an item with
    only those is pixel-free whatever its field names, and one with a pixel array is not."""
    from types import SimpleNamespace

    import torch
    from encode_client.vllm_connector import _has_local_input

    def feature(**fields: Any) -> Any:
        return SimpleNamespace(data={k: SimpleNamespace(data=v) for k, v in fields.items()})

    grid, seconds = torch.tensor([2, 4, 4]), torch.tensor(1.25)
    assert not _has_local_input(feature(video_grid_thw=grid, second_per_grid_ts=seconds), {"video_grid_thw"})
    assert not _has_local_input(feature(any_name=grid, another=seconds, stamps=[0.5, 1.5]), set())
    assert not _has_local_input(SimpleNamespace(data=None), set())
    for array in (torch.zeros(16, 1176), torch.zeros(3, 336, 336), [torch.zeros(3, 28, 28)]):
        assert _has_local_input(feature(image_grid_thw=grid, whatever=array), {"image_grid_thw"})
    # a declared metadata key never counts, whatever it holds
    assert not _has_local_input(feature(image_grid_thw=torch.zeros(1, 3)), {"image_grid_thw"})
