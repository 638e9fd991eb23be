"""Shared pieces of the SGLang tests: SGLang 0.5.23's receiving side in this process
(``tests/sglang/prefill.py``), real encode-server processes (the project's .venv,
``ENCODE_SERVER_PYTHON``) with SGLang's encoder protocol on, serving tiny seeded checkpoints, and a
real Redis under this session's own prefix.

Run by ``make test-sglang`` in the cached SGLang venv (``scripts/sglang_env.sh``); the server's venv,
which has no SGLang, leaves these tests out (tests/conftest.py).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MAKE = "make test-sglang (or: env=$(scripts/sglang_env.sh) && ENCODE_SERVER_PYTHON=$PWD/.venv/bin/python " \
       "PYTHONPATH=$PWD/clients/python:$PWD $env/bin/python -m pytest tests/sglang)"
if importlib.util.find_spec("sglang") is None:
    raise RuntimeError(f"tests/sglang need SGLang's wheel, which lives in its own environment: {MAKE}")
if not os.environ.get("ENCODE_SERVER_PYTHON"):
    raise RuntimeError(f"tests/sglang start encode-server from the project's venv: set ENCODE_SERVER_PYTHON; {MAKE}")

from tests.sglang.prefill import Prefill  # noqa: E402  (sets SGLang's environment before it is imported)
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl  # noqa: E402

REDIS_URL = os.environ.get("ENCODE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = f"test-sglang-{os.getpid()}"
# The door's flags: SGLang's protocol on; item URLs on loopback allowed (the tests serve some).
SGLANG_FLAGS = ("--sglang", "--sglang-fetch-private")


def png(width: int, height: int, seed: int) -> bytes:
    """A deterministic noisy PNG: distinct images give distinct embeddings."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    pixels = (rng.rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_item(data: bytes, *, with_hash: bool = True) -> dict[str, Any] | str:
    """An image as a user gives SGLang one: a data URI, with its ``content_hash`` (SGLang's
    ``sha256:<hex>`` of the bytes) or without."""
    if not with_hash:
        return data_uri(data)
    return {"url": data_uri(data), "content_hash": "sha256:" + hashlib.sha256(data).hexdigest()}


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL (tokenizer, processor, chat template; a video processor config)."""
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl"), video={})


@pytest.fixture(scope="session")
def replicas(qwen_dir: Path, logs: Path) -> Iterator[list[Any]]:
    """Two encode-servers on the tiny Qwen2.5-VL, sharing this session's Redis prefix, each with its
    gRPC port (SGLang's ``SglangEncoder`` beside our own service)."""
    import redis

    from tests.redis_procs import delete_prefix
    from tests.server import start_server

    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(
                "--model", str(qwen_dir), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX,
                "--dtype", "float32", *SGLANG_FLAGS, log_dir=logs, python=os.environ["ENCODE_SERVER_PYTHON"],
            ))
        yield servers
    finally:
        for server in servers:
            server.stop()
        delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


@pytest.fixture
def prefill_of() -> Iterator[Any]:
    """Builds SGLang prefills (one at a time: SGLang's configuration is process-wide), each closed
    after the test."""
    built: list[Prefill] = []

    def build(model_dir: Path, urls: list[str], **kwargs: Any) -> Prefill:
        prefill = Prefill(str(model_dir), urls, **kwargs)
        built.append(prefill)
        return prefill

    yield build
    for prefill in built:
        prefill.close()
