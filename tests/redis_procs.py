"""Redis for tests: our own ``redis-server`` processes on free loopback ports, ended by PID.

Fault tests pause and kill Redis, so they never use a shared one. Tests that only read and write
use the Redis at ``ENCODE_TEST_REDIS_URL`` (default 127.0.0.1:6379) under a per-run key prefix and
delete exactly their keys afterwards; where nothing answers there, they start their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.server import free_port, port_free

__all__ = [
    "RedisProcess",
    "delete_prefix",
    "free_cluster_port",
    "redis_cluster",
    "require_redis_binaries",
    "start_redis",
]


def require_redis_binaries() -> None:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found; install it: apt-get install -y redis-server")


def free_cluster_port(taken: set[int]) -> int:
    """A free port P below 55535 whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        port = free_port()  # this lane's range
        if port < 55535 and port not in taken and port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class RedisProcess:
    port: int
    args: tuple[str, ...]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = field(default=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), *self.args]
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not answer within {timeout} s")

    def kill(self) -> None:
        """SIGKILL, as a crash; only our own process, by its PID."""
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.resume()
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False


@contextmanager
def start_redis(*args: str, port: int | None = None) -> Iterator[RedisProcess]:
    require_redis_binaries()
    workdir = Path(tempfile.mkdtemp(prefix="encode-test-redis-"))
    server = RedisProcess(port or free_cluster_port(set()), args, workdir)
    try:
        server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def redis_cluster(masters: int = 3, timeout: float = 30.0) -> Iterator[list[RedisProcess]]:
    """``masters`` cluster-enabled redis-servers on loopback, joined by ``redis-cli --cluster create``."""
    require_redis_binaries()
    root = Path(tempfile.mkdtemp(prefix="encode-test-cluster-"))
    nodes: list[RedisProcess] = []
    try:
        taken: set[int] = set()
        for _ in range(masters):
            port = free_cluster_port(taken)
            taken |= {port, port + 10000}
            workdir = root / str(port)
            workdir.mkdir()
            node = RedisProcess(port, ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"), workdir)
            nodes.append(node)  # before start(): a node that never comes up is still killed below
            node.start()
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster_state did not become ok")
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(root, ignore_errors=True)


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete exactly the keys under ``prefix:`` (never FLUSHDB: the Redis may be shared)."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
    return len(keys)
