"""``encode_client.fetch``: a prefill worker's way to an embedding that Redis lost while an E still
holds it, against real servers: served by hash from a replica's local tier, replicas in the
client's rendezvous order, a replica that is down or says ``miss`` skipped, tenants' entries only
with their own key, an answer of another model refused, and a replica that never answers bounded."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from encode_client import Client, mm_hash, rank_replicas
from encode_client.fetch import EncoderFetcher
from encode_client.keys import tenant_digest
from encode_client.store import CorruptValue, StoredEmbedding

from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.server import ServerProcess, free_port, start_server

pytestmark = pytest.mark.integration

IMAGES = [image_bytes("PNG", 40 + 8 * i, 32, seed=210 + i) for i in range(6)]
KEYS = {"acme": "key-acme-21aa", "globex": "key-globex-21bb"}


@pytest.fixture(scope="module")
def replicas(server_logs: Path) -> Iterator[list[ServerProcess]]:
    """Two replicas without Redis: each holds only what it encoded, in its local tier."""
    servers = start_servers([], [], log_dir=server_logs)
    yield servers
    for s in servers:
        s.stop()


def _embedding(server: ServerProcess, image: bytes) -> np.ndarray:
    with Client(server.url, response="json") as client:
        return client.encode([image])[0].numpy()


def _fingerprint(server: ServerProcess) -> str:
    with Client(server.url) as client:
        return str(client.model()["fingerprint"])


def test_an_image_held_by_one_replica_is_fetched_by_hash_whatever_the_order(replicas: list[ServerProcess]) -> None:
    """Each image is encoded on one replica only; the fetcher finds every one of them, asking the
    first replica of the hash's rendezvous order first (a miss there, then the other)."""
    a, b = replicas
    urls = [a.url, b.url]
    expected = {}
    for i, image in enumerate(IMAGES):
        holder = (a, b)[i % 2]
        expected[mm_hash(image)] = (_embedding(holder, image), holder.url)
    fetcher = EncoderFetcher(urls, fingerprint=_fingerprint(a))
    got = fetcher.fetch_many(list(expected))
    for h, (embedding, _holder) in expected.items():
        value = got[h]
        assert isinstance(value, StoredEmbedding), (h, value)
        assert value.mm_hash == h and value.fingerprint == fetcher.fingerprint
        assert np.array_equal(value.numpy(), embedding)
    asked_second = sum(1 for h, (_, holder) in expected.items() if rank_replicas(h, urls)[0] != holder)
    assert fetcher.counts["hit"] == len(IMAGES) and fetcher.counts["miss"] == asked_second
    assert fetcher.fetch_many(["ab" * 32]) == {"ab" * 32: None}, "no replica holds it: None, not an error"


def test_a_replica_that_is_down_is_skipped_and_not_asked_again_for_a_while(replicas: list[ServerProcess]) -> None:
    a, _ = replicas
    image = image_bytes("PNG", 30, 30, seed=230)
    embedding = _embedding(a, image)
    nowhere = f"http://127.0.0.1:{free_port()}"
    fetcher = EncoderFetcher([nowhere, a.url], fingerprint=_fingerprint(a), down_for=60)
    for _ in range(2):
        value = fetcher.fetch_many([mm_hash(image)])[mm_hash(image)]
        assert isinstance(value, StoredEmbedding) and np.array_equal(value.numpy(), embedding)
    assert fetcher.counts["error"] <= 1, "the replica that is down was asked again within down_for"
    everything_down = EncoderFetcher([nowhere], fingerprint=_fingerprint(a))
    assert everything_down.fetch_many([mm_hash(image)]) == {mm_hash(image): None}
    assert everything_down.counts["error"] == 1


def test_an_answer_of_another_model_is_refused(replicas: list[ServerProcess]) -> None:
    a, _ = replicas
    image = IMAGES[0]
    _embedding(a, image)
    fetcher = EncoderFetcher([a.url], fingerprint="0" * 64)
    value = fetcher.fetch_many([mm_hash(image)])[mm_hash(image)]
    assert isinstance(value, CorruptValue) and "fingerprint" in str(value)


@pytest.fixture()
def silent_replica() -> Iterator[str]:
    """A port that accepts connections and never answers."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_a_replica_that_never_answers_costs_at_most_the_timeout(silent_replica: str) -> None:
    fetcher = EncoderFetcher([silent_replica], fingerprint="1" * 64, timeout=0.5)
    h = mm_hash(IMAGES[1])
    assert fetcher.fetch_many([h]) == {h: None}
    assert fetcher.counts["error"] == 1


def test_a_tenants_entry_is_fetched_only_with_that_tenants_key(shared_redis_url: str, server_logs: Path) -> None:
    spec = ",".join(f"{t}:{k}" for t, k in KEYS.items())
    server = start_server("--tenant-isolation", "--api-keys", spec, log_dir=server_logs)
    try:
        image = image_bytes("PNG", 36, 36, seed=240)
        h = mm_hash(image)
        with Client(server.url, api_key=KEYS["acme"], response="json") as acme:
            embedding = acme.encode([image])[0].numpy()
            fingerprint = str(acme.model()["fingerprint"])
        acme_id, globex_id = (f"t:{tenant_digest(t)}:{h}" for t in KEYS)
        fetcher = EncoderFetcher([server.url], fingerprint=fingerprint, api_keys=spec)
        got = fetcher.fetch_many([acme_id, globex_id, h])
        value = got[acme_id]
        assert isinstance(value, StoredEmbedding) and np.array_equal(value.numpy(), embedding)
        assert value.key.endswith(acme_id)
        assert got[globex_id] is None, "globex's key sees globex's entries only: acme's image is a miss"
        assert got[h] is None, "a plain identifier without a plain key: refused (401), never another tenant's entry"
        keyless = EncoderFetcher([server.url], fingerprint=fingerprint, api_key=KEYS["globex"])
        assert keyless.fetch_many([acme_id]) == {acme_id: None}
        assert keyless.counts["no_key"] == 1 and keyless.counts["requests"] == 0, "never asked with another key"
    finally:
        server.stop()
