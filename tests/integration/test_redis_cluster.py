"""A three-master Redis Cluster of our own on loopback: cross-replica hits through redis-py's
cluster client (keys spread over every master), and the store reader in cluster mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from encode_client.store import StoreReader

from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.integration.test_redis_shared import b64, encode, h, wait_for_redis_hit
from tests.redis_procs import RedisProcess, redis_cluster
from tests.server import ServerProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisProcess]]:
    with redis_cluster(3) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def replicas(cluster: list[RedisProcess], server_logs: Path) -> Iterator[list[ServerProcess]]:
    seed = cluster[0].port
    a, b = start_servers(
        ["--redis-url", f"redis+cluster://127.0.0.1:{seed}"],
        ["--redis-url", f"redis://127.0.0.1:{cluster[1].port}", "--redis-cluster", "--cache-mb", "0"],
        log_dir=server_logs,
    )
    yield [a, b]
    a.stop()
    b.stop()


def test_cross_replica_hits_through_a_three_master_cluster(
    cluster: list[RedisProcess], replicas: list[ServerProcess]
) -> None:
    a, b = replicas
    images = [image_bytes("PNG", 50 + i, 40, seed=900 + i) for i in range(8)]
    uploaded = encode(a, [{"data": b64(d)} for d in images]).json()["items"]
    assert [i["status"] for i in uploaded] == ["encoded"] * 8
    for data, first in zip(images, uploaded, strict=True):
        item = wait_for_redis_hit(b, h(data))
        assert (item["status"], item["source"], item["embedding"]) == ("hit", "redis", first["embedding"])
    # One multi-key read across slots on several masters.
    items = encode(b, [{"hash": h(d)} for d in images]).json()["items"]
    assert {(i["status"], i["source"]) for i in items} == {("hit", "redis")}
    assert sum(1 for n in cluster if n.client().dbsize() > 0) >= 2, "keys should spread over several masters"

    handed = encode(a, [{"data": b64(image_bytes("PNG", 77, 66, seed=999))}], **{"return": "metadata"}).json()
    key = handed["items"][0]["key"]
    with StoreReader(f"redis+cluster://127.0.0.1:{cluster[2].port}") as store:
        emb = store.get(key)
    assert emb is not None and list(emb.shape) == handed["items"][0]["shape"]

