"""The shared Redis tier across real server processes: cross-replica hits, the metadata hand-off
read back by the client's store reader, and corrupted values (never served, re-encoded, counted).

Runs on the shared Redis under a per-run key prefix, and deletes exactly those keys afterwards.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from encode_client.store import CorruptValue, StoreReader, parse_value

from encode_server.core.stored import encode_value
from encode_server.core.types import Embedding, EncodedTensor
from tests.calls import b64, encode, h, metric
from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration


def wait_for_redis_hit(server: ServerProcess, mm_hash: str, timeout: float = 10.0) -> dict:
    """Writes go behind the response: poll (bounded) until a hash-only request hits Redis."""
    deadline = time.monotonic() + timeout
    while True:
        item = encode(server, [{"hash": mm_hash}]).json()["items"][0]
        if item["status"] == "hit" or time.monotonic() > deadline:
            return item
        time.sleep(0.05)


class Pair:
    def __init__(self, a: ServerProcess, b: ServerProcess, prefix: str, client: redis.Redis, url: str) -> None:
        self.a, self.b, self.prefix, self.client, self.url = a, b, prefix, client, url
        self.fingerprint = httpx.get(a.url + "/v1/model").json()["fingerprint"]

    def key(self, mm_hash: str) -> str:
        return f"{self.prefix}:v1:{self.fingerprint}:{mm_hash}"


@pytest.fixture(scope="module")
def pair(shared_redis_url: str, server_logs: Path) -> Iterator[Pair]:
    """Two replicas on one Redis. B has no local tier, so every one of its hits comes from Redis."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    common = ["--redis-url", shared_redis_url, "--cache-prefix", prefix, "--max-wait-ms", "5"]
    a, b = start_servers(common, [*common, "--cache-mb", "0"], log_dir=server_logs)
    client = redis.Redis.from_url(shared_redis_url)
    try:
        yield Pair(a, b, prefix, client, shared_redis_url)
    finally:
        a.stop()
        b.stop()
        delete_prefix(client, prefix)
        client.close()


def test_the_start_up_line_says_the_shared_tier_is_reachable(pair: Pair) -> None:
    for server in (pair.a, pair.b):
        said = [line for line in server.log().splitlines() if "shared tier: redis" in line]
        assert len(said) == 1 and " INFO " in said[0] and ", reachable), ttl " in said[0], said


def test_upload_to_one_replica_is_a_byte_identical_redis_hit_on_another(pair: Pair) -> None:
    images = [image_bytes("PNG", 60 + 7 * i, 50, seed=100 + i) for i in range(3)]
    uploaded = encode(pair.a, [{"data": b64(d)} for d in images]).json()["items"]
    assert [i["status"] for i in uploaded] == ["encoded"] * 3
    for data, first in zip(images, uploaded, strict=True):
        item = wait_for_redis_hit(pair.b, h(data))
        assert (item["status"], item["source"]) == ("hit", "redis")
        assert item["embedding"] == first["embedding"]
        assert (item["shape"], item["dtype"], item["meta"]) == (first["shape"], first["dtype"], first["meta"])
    found = httpx.post(pair.b.url + "/v1/lookup", json={"hashes": [h(images[0]), "ee" * 32]}).json()["items"]
    assert [(f["cached"], f["tier"]) for f in found] == [(True, "redis"), (False, None)]
    assert metric(pair.b, "encode_server_redis_up") == 1.0


def test_metadata_hand_off_is_read_back_by_the_store_reader_as_the_same_tensor(pair: Pair) -> None:
    fresh, known = image_bytes("PNG", 90, 70, seed=200), image_bytes("PNG", 70, 90, seed=201)
    encode(pair.a, [{"data": b64(known)}])  # a local hit on A for the hand-off below
    r = encode(pair.a, [{"data": b64(fresh)}, {"hash": h(known)}, {"data": b64(fresh)}], **{"return": "metadata"})
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert [i["status"] for i in items] == ["encoded", "hit", "encoded"]
    assert all("embedding" not in i and i["key"] == pair.key(i["hash"]) for i in items)
    missed = encode(pair.a, [{"hash": "ee" * 32}], **{"return": "metadata"}).json()["items"][0]
    assert missed["status"] == "miss" and "key" not in missed  # nothing is stored under it
    full = encode(pair.a, [{"hash": h(fresh)}, {"hash": h(known)}]).json()["items"]
    with StoreReader(pair.url, fingerprint=pair.fingerprint) as store:
        stored = store.get_many([items[0]["key"], items[1]["key"]])  # in Redis already: no waiting
    for emb, item, meta_item in zip(stored, full, items[:2], strict=True):
        assert emb is not None
        expected = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(item["shape"])
        np.testing.assert_array_equal(emb.numpy(), expected)
        assert (list(emb.shape), emb.dtype, emb.meta) == (meta_item["shape"], meta_item["dtype"], meta_item["meta"])


def wait_for_valid_value(pair: Pair, key: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        blob = pair.client.get(key)
        try:
            parse_value(key, blob or b"", fingerprint=pair.fingerprint)
            return
        except CorruptValue:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def corrupt_values(pair: Pair, mm_hash: str, good: bytes) -> dict[str, bytes]:
    t = EncodedTensor(np.ones((4, 128), dtype="<f4").tobytes(), (4, 128), "float32")
    wide = EncodedTensor(np.ones((4, 129), dtype="<f4").tobytes(), (4, 129), "float32")
    return {
        "truncated": good[: len(good) // 2],
        "random_bytes": np.random.default_rng(7).bytes(4096),
        "another_fingerprint": encode_value("0" * 64, mm_hash, Embedding(t, {})),
        "wrong_shape": encode_value(pair.fingerprint, mm_hash, Embedding(wide, {})),
    }


def test_corrupted_values_are_never_served_then_re_encoded_overwritten_and_counted(pair: Pair) -> None:
    # A good value to truncate, from an image whose bytes we never send again.
    donor = image_bytes("PNG", 64, 64, seed=299)
    encode(pair.a, [{"data": b64(donor)}], **{"return": "metadata"})
    good = pair.client.get(pair.key(h(donor)))
    assert good is not None
    corrupt_before = metric(pair.b, "encode_server_cache_lookups_total", '{result="corrupt",tier="redis"}')
    cases = ["truncated", "random_bytes", "another_fingerprint", "wrong_shape"]
    for n, case in enumerate(cases):
        data = image_bytes("PNG", 64, 48, seed=300 + n)
        key = pair.key(h(data))
        pair.client.set(key, corrupt_values(pair, h(data), good)[case], ex=600)
        miss = encode(pair.b, [{"hash": h(data)}]).json()["items"][0]
        assert (miss["status"], "embedding" in miss) == ("miss", False), case
        again = encode(pair.b, [{"data": b64(data)}]).json()["items"][0]
        assert (again["status"], again["source"]) == ("encoded", "encoder"), case
        wait_for_valid_value(pair, key)  # the re-encode overwrites the bad value, behind the response
        item = encode(pair.b, [{"hash": h(data)}]).json()["items"][0]
        assert (item["status"], item["source"], item["embedding"]) == ("hit", "redis", again["embedding"]), case
    corrupt_after = metric(pair.b, "encode_server_cache_lookups_total", '{result="corrupt",tier="redis"}')
    assert corrupt_after - corrupt_before == 2 * len(cases)  # the hash-only miss and the upload's lookup


def test_tenant_isolation_holds_in_the_shared_tier(shared_redis_url: str, server_logs: Path) -> None:
    """Replica B answers acme's hash from Redis, and never tells globex that acme sent it."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    keys = {"ENCODE_SERVER_API_KEYS": "acme:acme-key-1, globex:globex-key-2"}
    common = ["--redis-url", shared_redis_url, "--cache-prefix", prefix, "--tenant-isolation"]
    a, b = (start_server(*common, log_dir=server_logs, env=keys) for _ in range(2))
    acme, globex = {"Authorization": "Bearer acme-key-1"}, {"Authorization": "Bearer globex-key-2"}
    try:
        data = image_bytes("PNG", 44, 44, seed=77)
        sent = httpx.post(a.url + "/v1/encode", json={"items": [{"data": b64(data)}]}, headers=acme, timeout=60)
        assert sent.json()["items"][0]["status"] == "encoded"
        deadline = time.monotonic() + 10
        while True:
            item = httpx.post(b.url + "/v1/encode", json={"items": [{"hash": h(data)}]}, headers=acme).json()
            if item["items"][0]["status"] == "hit" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (item["items"][0]["status"], item["items"][0]["source"]) == ("hit", "redis")
        assert item["items"][0]["embedding"] == sent.json()["items"][0]["embedding"]
        for server in (a, b):
            miss = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": h(data)}]}, headers=globex)
            assert miss.json()["items"][0]["status"] == "miss"
            look = httpx.post(server.url + "/v1/lookup", json={"hashes": [h(data)]}, headers=globex)
            assert look.json()["items"][0]["cached"] is False
    finally:
        for server in (a, b):
            assert server.stop() == 0, server.log()
        delete_prefix(redis.Redis.from_url(shared_redis_url), prefix)


def test_entries_get_the_ttl_and_oversize_values_are_not_written(shared_redis_url: str, server_logs: Path) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    server = start_server(
        "--redis-url", shared_redis_url, "--cache-prefix", prefix,
        "--redis-ttl", "100", "--redis-max-value-mb", str(64 / 1024),  # 64 KiB
        log_dir=server_logs,
    )
    client = redis.Redis.from_url(shared_redis_url)
    try:
        fingerprint = httpx.get(server.url + "/v1/model").json()["fingerprint"]
        small = image_bytes("PNG", 56, 56, seed=90)  # 4 tokens x 128 x 4 B = 2 KiB
        big = image_bytes("JPEG", 448, 448, seed=91)  # 256 tokens x 128 x 4 B = 128 KiB
        items = encode(server, [{"data": b64(small)}, {"data": b64(big)}]).json()["items"]
        assert [i["status"] for i in items] == ["encoded", "encoded"]
        small_key, big_key = (f"{prefix}:v1:{fingerprint}:{h(d)}" for d in (small, big))
        deadline = time.monotonic() + 10
        while not client.exists(small_key) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0 < client.ttl(small_key) <= 100
        assert not client.exists(big_key)
        assert metric(server, "encode_server_redis_writes_total", '{result="too_large"}') == 1
    finally:
        assert server.stop() == 0, server.log()
        delete_prefix(client, prefix)
