"""deploy/redis/users.acl, loaded by a real redis-server, with the real server and the connector's
store reader: encode-server reads and writes its prefix and nothing else, the connector only reads
it, and a connection without a user may only PING (the probes). Whoever can write Redis decides
what the model sees in every image (docs/vllm.md, "Redis ACLs"), so no one else may.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from encode_client import Client
from encode_client.store import StoreReader

from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.redis_procs import RedisProcess, start_redis
from tests.server import ServerProcess

pytestmark = pytest.mark.integration

ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "redis" / "users.acl"


def passwords() -> dict[str, str]:
    """Each user's password in the deployed file (its placeholders: the rules are what is tested)."""
    found = dict(re.findall(r"^user (\S+) on .*?>(\S+)", ACL_FILE.read_text(), flags=re.M))
    assert set(found) == {"encode-server", "vllm-connector"}, found
    return found


def url(proc: RedisProcess, user: str) -> str:
    return f"redis://{user}:{passwords()[user]}@127.0.0.1:{proc.port}/0"


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisProcess]:
    with start_redis("--aclfile", str(ACL_FILE)) as proc:
        yield proc


@pytest.fixture(scope="module")
def servers(acl_redis: RedisProcess, server_logs: Path) -> Iterator[list[ServerProcess]]:
    """Two servers as the encode-server user (the default --cache-prefix, which the file names)."""
    procs = start_servers(*[["--redis-url", url(acl_redis, "encode-server")]] * 2, log_dir=server_logs)
    yield procs
    for proc in procs:
        proc.stop()


def _redis_errors(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("encode_server_redis_errors_total{"))


def test_the_server_user_does_all_the_server_does(servers: list[ServerProcess]) -> None:
    image = image_bytes("PNG", 48, 40, seed=181)
    with Client(servers[0].url) as first, Client(servers[1].url) as second:
        handed = first.hand_off([image])[0]  # EXISTS, SET: written before the answer
        assert handed.key and handed.key.startswith("encode:v1:")
        again = second.encode([image])[0]  # a cold local tier: MGET from Redis
        assert (again.status, again.source) == ("hit", "redis")
        assert second.lookup([again.hash])[0].cached
    assert [_redis_errors(s) for s in servers] == [0, 0], "a command the server sends is not allowed"


def test_the_connector_user_reads_the_prefix_and_nothing_else(
    acl_redis: RedisProcess, servers: list[ServerProcess]
) -> None:
    image = image_bytes("PNG", 30, 60, seed=182)
    with Client(servers[0].url) as client:
        key = str(client.hand_off([image])[0].key)
        fingerprint = client.model()["fingerprint"]
    with StoreReader(url(acl_redis, "vllm-connector"), fingerprint=fingerprint) as store:
        assert store.get(key) is not None
    reader = redis.Redis.from_url(url(acl_redis, "vllm-connector"))
    blob = reader.get(key)
    for command in (lambda: reader.set(key, b"forged"), lambda: reader.delete(key), lambda: reader.get("other:x"),
                    lambda: reader.flushall(), lambda: reader.config_set("maxmemory", "1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    assert reader.get(key) == blob


def test_the_server_user_cannot_leave_its_prefix_nor_administer(acl_redis: RedisProcess) -> None:
    writer = redis.Redis.from_url(url(acl_redis, "encode-server"))
    writer.set("encode:v1:probe", b"1", ex=60)
    for command in (lambda: writer.set("other:x", b"1"), lambda: writer.get("other:x"),
                    lambda: writer.delete("encode:v1:probe"), lambda: writer.keys("*"), lambda: writer.flushall(),
                    lambda: writer.config_set("maxmemory", "1"), lambda: writer.acl_list()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()


def test_a_connection_without_a_user_may_only_ping(acl_redis: RedisProcess) -> None:
    anonymous = acl_redis.client()
    assert anonymous.ping()
    for command in (lambda: anonymous.get("encode:v1:probe"), lambda: anonymous.set("encode:v1:x", b"1"),
                    lambda: anonymous.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
