"""vLLM's dtype without a flag on either side: encode-server's ``--dtype auto`` is vLLM 0.32's
``auto`` (the rule against vLLM's own function for every platform list; both servers' choice for
real checkpoints on this machine), EPD answers equal vLLM's own on the pixels for a bfloat16
checkpoint with no ``--dtype`` anywhere, and the connector says so, once and loudly, when a stored
dtype is not the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import Client
from encode_client.keys import store_key

from encode_server.core.dtypes import auto_dtype
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    REDIS_URL,
    connector_config,
    engine,
    greedy,
    metadata_only,
    pixels,
    png,
    scheduler_connector,
    stored_value,
)
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl

PREFIX = f"test-vllm-dtype-{__import__('os').getpid()}"
IMAGES = [png(w, h, seed=300 + i) for i, (w, h) in enumerate([(56, 56), (112, 84), (224, 168), (84, 112)])]


class _Platform:
    """What ``vllm.config.model._resolve_auto_dtype`` asks of the current platform."""

    def __init__(self, supported: list[Any]) -> None:
        self.supported_dtypes = supported

    def get_device_name(self) -> str:
        return "test device"

    def get_device_capability(self) -> None:
        return None


def test_the_rule_is_vllms_for_every_platform_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our pure rule against vLLM 0.32's own ``_resolve_auto_dtype`` (a generating model), for each
    platform's dtype list, every checkpoint dtype and a model type vLLM refuses float16 for."""
    import torch
    import vllm.config.model as model_config

    names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    lists = [
        [torch.bfloat16, torch.float16, torch.float32],  # CUDA >= 8.0, x86 and ARM CPUs
        [torch.float16, torch.float32],  # CUDA 6.x-7.x, a Mac without bf16
        [torch.float32],
        [torch.bfloat16, torch.float32, torch.float16],  # POWER (before its bf16 override)
    ]
    checked = 0
    for supported in lists:
        monkeypatch.setattr(model_config, "current_platform", _Platform(supported))
        for model_type in ("qwen2_5_vl", "gemma3"):
            for config_dtype in names:
                try:
                    theirs = names[model_config._resolve_auto_dtype(model_type, config_dtype, is_pooling_model=False)]
                except IndexError:  # no usable dtype at all (gemma3 on a float16-only list): none here either
                    continue
                ours = auto_dtype(names[config_dtype], model_type, [names[d] for d in supported])
                assert ours == theirs, (supported, model_type, config_dtype)
                checked += 1
    assert checked >= 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dtype-checkpoints")
    return {d: make_tiny_qwen2_5_vl(root / d, dtype=d) for d in ("bfloat16", "float16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_both_servers_pick_the_same_dtype_without_a_flag(
    checkpoints: dict[str, Path], logs: Path, dtype: str
) -> None:
    """encode-server (no --dtype) publishes the dtype vLLM's ``auto`` resolves for the same
    checkpoint on this machine, and says why."""
    from transformers import AutoConfig
    from vllm.config.model import _get_and_verify_dtype

    path = checkpoints[dtype]
    theirs = _get_and_verify_dtype(str(path), AutoConfig.from_pretrained(path), "auto", is_pooling_model=False)
    server = start_server("--model", str(path), "--grpc-port", "0", log_dir=logs)
    try:
        model = httpx.get(server.url + "/v1/model", timeout=30).json()
    finally:
        server.stop()
    assert model["dtype"] == str(theirs).removeprefix("torch."), model["dtype_reason"]
    assert "vLLM" in model["dtype_reason"] and dtype in model["dtype_reason"]


@pytest.fixture(scope="module")
def bf16_server(checkpoints: dict[str, Path], logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(checkpoints["bfloat16"]), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX,
        "--grpc-port", "0", log_dir=logs,
    )
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


@pytest.fixture(scope="module")
def bf16_llm(checkpoints: dict[str, Path], bf16_server: ServerProcess) -> Iterator[Any]:
    """vLLM with ``--dtype auto`` and its tower, an EC consumer: the EPD request and the pixels
    request (vLLM's own tower) on one engine."""
    config = connector_config(REDIS_URL, bf16_server.url, PREFIX)
    with engine(checkpoints["bfloat16"], config, tower=True, dtype="auto") as llm:
        yield llm


def test_epd_answers_equal_vllms_own_with_no_dtype_flag(
    bf16_llm: Any, bf16_server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: a bfloat16 checkpoint, no --dtype on either side. Both run bfloat16; the
    EPD request's tokens equal vLLM's own on the pixels for every image; no dtype warning."""
    assert str(bf16_llm.llm_engine.model_config.dtype) == "torch.bfloat16"
    with Client(bf16_server.url, response="json", timeout=60) as client:
        assert client.model()["dtype"] == "bfloat16"
        results = client.hand_off(IMAGES)
    caplog.set_level(logging.WARNING, logger="encode_client.vllm_connector")
    epd = greedy(bf16_llm, [metadata_only(r.meta["image_grid_thw"], r.hash) for r in results])
    assert scheduler_connector(bf16_llm).counts["from_redis"] >= len(IMAGES)
    bf16_llm.llm_engine.reset_encoder_cache()
    own = greedy(bf16_llm, [pixels(data) for data in IMAGES])
    assert epd == own
    assert scheduler_connector(bf16_llm).counts["dtype_mismatch"] == 0
    assert not [r for r in caplog.records if "DTYPE MISMATCH" in r.getMessage()]


def test_a_stored_dtype_other_than_the_engines_is_said_once_and_loudly(
    bf16_llm: Any, bf16_server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """float32 values (an encode-server started with --dtype float32) in front of a bfloat16
    engine: used (converted), and one warning naming both dtypes, however many images."""
    with Client(bf16_server.url, response="json", timeout=60) as client:
        fingerprint = str(client.model()["fingerprint"])
        encoded = client.encode(IMAGES[:2])
    store = redis.Redis.from_url(REDIS_URL)
    for r in encoded:
        value = stored_value(r.numpy().astype(np.float32), fingerprint, r.hash, dict(r.meta))
        store.set(store_key(fingerprint, r.hash, prefix=PREFIX), value)
    caplog.set_level(logging.WARNING, logger="encode_client.vllm_connector")
    for r in encoded:  # two requests, two steps
        bf16_llm.llm_engine.reset_encoder_cache()
        assert greedy(bf16_llm, [metadata_only(r.meta["image_grid_thw"], r.hash)])[0]
    warnings = [r.getMessage() for r in caplog.records if "DTYPE MISMATCH" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "float32" in warnings[0] and "bfloat16" in warnings[0]
    assert scheduler_connector(bf16_llm).counts["dtype_mismatch"] == 1
