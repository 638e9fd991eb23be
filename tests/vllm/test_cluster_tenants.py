"""Redis Cluster and ``--tenant-isolation`` through the connector and the proxy: a tower-free vLLM
consumer reading a three-master cluster (``redis+cluster://``), an isolated encode-server on it,
and the proxy authenticating two tenants with encode-server's own key list.

A tenant's prefill never reads another tenant's embedding: each tenant's identifier names its own
cluster key, each answer follows its own entry (another tenant's entry replaced by zeros changes
only that tenant's answer), and when the cluster loses a tenant's value the connector's fallback
asks encode-server with that tenant's key only: a tenant the connector has no key for fails
cleanly instead of being served under another tenant's key.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.cluster
from encode_client import Client, mm_hash
from encode_client.keys import store_key, tenant_digest
from encode_client.proxy import EPDProxy

from tests.redis_procs import RedisProcess, redis_cluster
from tests.server import ServerProcess, start_server
from tests.vllm.conftest import png, running_proxy, stored_value
from tests.vllm.epd_stack import Relay, chat, post_chat, vllm_openai_server

PREFIX = f"test-vllm-cluster-{os.getpid()}"
KEYS = {"acme": "key-acme-c1u5", "globex": "key-globex-c1u5"}
SPEC = ",".join(f"{t}:{k}" for t, k in KEYS.items())
SIZE = (112, 84)


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisProcess]]:
    with redis_cluster(3) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def cluster_url(cluster: list[RedisProcess]) -> str:
    return f"redis+cluster://127.0.0.1:{cluster[0].port}/0"


@pytest.fixture(scope="module")
def store(cluster: list[RedisProcess]) -> Iterator[Any]:
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster[1].port)
    yield client
    client.close()


@pytest.fixture(scope="module")
def server(model_dir: Path, cluster_url: str, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(model_dir), "--redis-url", cluster_url, "--cache-prefix", PREFIX, "--grpc-port", "0",
        "--tenant-isolation", "--api-keys", SPEC, "--dtype", "float32", log_dir=logs,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def consumer(model_dir: Path, cluster_url: str, server: ServerProcess, logs: Path) -> Iterator[dict[str, Any]]:
    """The tower-free consumer on the cluster; its fallback holds acme's key only."""
    extra = {"redis_url": cluster_url, "encoder_url": server.url, "prefix": PREFIX,
             "api_keys": f"acme:{KEYS['acme']}"}
    with vllm_openai_server(model_dir, extra, logs) as s:
        yield s


@pytest.fixture(scope="module")
def relay(consumer: dict[str, Any]) -> Iterator[Relay]:
    with Relay(consumer["port"]) as r:
        yield r


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [server.url], api_keys=SPEC) as p:
        yield p


@pytest.fixture(scope="module")
def fingerprint(server: ServerProcess) -> str:
    with Client(server.url, api_key=KEYS["acme"]) as client:
        return str(client.model()["fingerprint"])


def answer(r: Any) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def given(consumer: dict[str, Any], embedding: np.ndarray, grid: list[int]) -> str:
    """The consumer's answer for an embedding sent to it as a tensor (no uuid)."""
    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(np.array(embedding, dtype=np.float32)), buf)
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": base64.b64encode(buf.getvalue()).decode(),
                                                      "image_grid_thw": grid}}
    return answer(post_chat(consumer["url"], chat([], part)))


def _own(server: ServerProcess, tenant: str, image: bytes) -> tuple[np.ndarray, list[int]]:
    with Client(server.url, api_key=KEYS[tenant], response="json") as client:
        r = client.encode([image])[0]
    return r.numpy(), list(r.meta["image_grid_thw"])


def test_each_tenant_reads_its_own_cluster_entry(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, consumer: dict[str, Any], store: Any, fingerprint: str
) -> None:
    image = png(*SIZE, seed=2100)
    h = mm_hash(image)
    key = {t: store_key(fingerprint, h, prefix=PREFIX, tenant=t) for t in KEYS}

    mark = relay.mark()
    acme = answer(post_chat(proxy.url, chat([image]), key=KEYS["acme"]))
    assert relay.uuids_since(mark) == [f"t:{tenant_digest('acme')}:{h}"]
    assert store.exists(key["acme"]) and not store.exists(key["globex"])
    assert not store.exists(store_key(fingerprint, h, prefix=PREFIX)), "no untenanted key"
    embedding, grid = _own(server, "acme", image)
    assert acme == given(consumer, embedding, grid), "acme's answer is acme's embedding's"

    zeros = np.zeros_like(embedding)
    store.set(key["globex"], stored_value(zeros, fingerprint, h, {"image_grid_thw": grid}))
    mark = relay.mark()
    globex = answer(post_chat(proxy.url, chat([image]), key=KEYS["globex"]))
    assert relay.uuids_since(mark) == [f"t:{tenant_digest('globex')}:{h}"]
    assert globex == given(consumer, zeros, grid) != acme, "globex's answer follows globex's entry"
    assert answer(post_chat(proxy.url, chat([image]), key=KEYS["acme"])) == acme, "and acme's still acme's"


def test_a_lost_value_is_fetched_with_its_own_tenants_key_only(
    proxy: EPDProxy, server: ServerProcess, consumer: dict[str, Any], store: Any, fingerprint: str
) -> None:
    """Both tenants' values for one image lost from the cluster, the images still in
    encode-server's local tier: acme's metadata-only request (straight to the consumer, so no
    second hand-off) is served by the fallback with acme's key; globex's fails, since the
    connector holds no globex key and never asks with another tenant's."""
    image = png(*SIZE, seed=2101)
    h = mm_hash(image)
    answers = {t: answer(post_chat(proxy.url, chat([image]), key=KEYS[t])) for t in KEYS}
    assert answers["acme"] == answers["globex"]
    _, grid = _own(server, "acme", image)
    keys = [store_key(fingerprint, h, prefix=PREFIX, tenant=t) for t in KEYS]
    for key in keys:
        assert store.delete(key) == 1

    def metadata_only(tenant: str) -> dict[str, Any]:
        part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid},
                "uuid": f"t:{tenant_digest(tenant)}:{h}"}
        return chat([], part)

    assert answer(post_chat(consumer["url"], metadata_only("acme"))) == answers["acme"]
    assert not any(store.exists(k) for k in keys), "acme's value came from encode-server, not the cluster"
    r = post_chat(consumer["url"], metadata_only("globex"))
    assert r.status_code == 500 and "InternalServerError" in r.text, r.text
