"""The EPD path over HTTP for a family vLLM takes as pixels + uuid (a tiny InternVL): client ->
encode-epd-proxy -> vLLM's OpenAI server (an EC consumer with ``EncodeServerECConnector``), with
encode-server and Redis beside them, all on loopback, and a recording relay in front of vLLM.

The proxy reads the family's mode from encode-server's ``GET /v1/model`` and keeps each image in
the request, adding its identifier; vLLM's processor sizes the placeholder from the pixels and the
connector supplies the embedding. vLLM runs its processor on the PIL backend (the server's).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.epd import rewrite_chat_request
from encode_client.keys import store_key
from encode_client.proxy import EPDProxy

from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, start_server
from tests.tiny.internvl import make_tiny_internvl
from tests.vllm.conftest import REDIS_URL, metric, png, running_proxy, stored_value
from tests.vllm.epd_stack import Relay, answer_text, chat, post_chat, vllm_openai_server

PREFIX = f"test-vllm-pixels-uuid-{os.getpid()}"
IMAGES = [png(56, 56, seed=80), png(112, 56, seed=81)]  # one tile; two tiles and a thumbnail
# Images no request has named yet: vLLM's encoder cache keeps an item under its uuid across
# requests, and would answer from there instead of asking the connector.
FRESH = [png(56, 56, seed=90), png(112, 56, seed=91)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("tiny-internvl"))


@pytest.fixture(scope="module")
def server(checkpoint: Path, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(checkpoint), "--redis-url", REDIS_URL, "--cache-prefix", PREFIX, "--grpc-port", "0",
        "--dtype", "float32", log_dir=logs,
    )
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(REDIS_URL), PREFIX)


@pytest.fixture(scope="module")
def vllm(checkpoint: Path, server: ServerProcess, logs: Path) -> Iterator[dict[str, Any]]:
    extra = {"redis_url": REDIS_URL, "encoder_url": server.url, "prefix": PREFIX}
    args = ["--mm-processor-kwargs", json.dumps({"use_fast": False})]
    with vllm_openai_server(checkpoint, extra, logs, extra_args=args, tower=True) as running:
        yield running


@pytest.fixture(scope="module")
def relay(vllm: dict[str, Any]) -> Iterator[Relay]:
    with Relay(vllm["port"]) as r:
        yield r


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [server.url]) as p:
        yield p


def _encoded(server: ServerProcess) -> float:
    return metric(httpx.get(server.url + "/metrics", timeout=10).text, "encode_server_items_total", status="encoded")


def test_chat_through_the_proxy_keeps_the_pixels_and_names_them(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, vllm: dict[str, Any]
) -> None:
    """vLLM receives each image with uuid = its mm_hash (no metadata-only part), and the answer is
    plain vLLM's on the same pixels."""
    encoded, mark = _encoded(server), relay.mark()
    answer = answer_text(post_chat(proxy.url, chat(IMAGES)))
    sent = relay.since(mark)
    assert relay.uuids_since(mark) == [mm_hash(d) for d in IMAGES]
    for data in IMAGES:
        assert base64.b64encode(data)[-64:] in sent, "the image is in the request to vLLM"
    assert b"image_embeds" not in sent
    assert _encoded(server) == encoded + len(IMAGES)
    assert answer_text(post_chat(proxy.url, chat(IMAGES))) == answer
    assert answer_text(post_chat(vllm["url"], chat(IMAGES))) == answer  # straight to vLLM: it encodes itself


def test_vllms_openai_server_takes_the_embedding_by_the_uuid(
    proxy: EPDProxy, server: ServerProcess, vllm: dict[str, Any]
) -> None:
    """The proof that the answer came from the store: the rewritten request (as the proxy sends it,
    for images vLLM has not cached yet) straight to vLLM after the stored values are replaced by
    zeros gives another answer than plain vLLM's on the pixels."""
    plain = answer_text(post_chat(vllm["url"], chat(FRESH)))
    with Client(server.url, response="json") as client:
        rewritten, results = rewrite_chat_request(chat(FRESH), client)
        fingerprint = str(client.model()["fingerprint"])
        embeddings = [r.numpy() for r in client.encode(FRESH)]
        store = redis.Redis.from_url(REDIS_URL)
        for result, emb in zip(results, embeddings, strict=True):
            zeros = stored_value(np.zeros_like(emb), fingerprint, result.hash, result.meta)
            store.set(store_key(fingerprint, result.hash, prefix=PREFIX), zeros)
        poisoned = answer_text(post_chat(vllm["url"], rewritten))
    assert poisoned != plain, "zeros under the keys did not change the answer: vLLM did not read the store"
