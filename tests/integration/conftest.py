from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from tests.redis_procs import start_redis
from tests.server import ServerProcess, start_server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def builtin_server(server_logs: Path) -> Iterator[ServerProcess]:
    """The built-in model with small limits, so that every limit can be crossed cheaply."""
    server = start_server(
        "--max-items", "8",
        "--max-request-bytes", str(2 * 1024 * 1024),
        "--max-image-pixels", str(4096 * 4096),
        "--max-wait-ms", "50",
        "--cache-mb", "64",
        log_dir=server_logs,
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="session")
def shared_redis_url() -> Iterator[str]:
    """The Redis at ENCODE_TEST_REDIS_URL (default 127.0.0.1:6379), or our own one when nothing
    answers there: never a skip. Tests on it use their own key prefix and delete their keys."""
    url = os.environ.get("ENCODE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping()
    except redis.ConnectionError:
        with start_redis() as own:
            yield own.url
        return
    yield url


def start_servers(*arg_lists: list[str], log_dir: Path) -> list[ServerProcess]:
    """Start several servers at once (each loads the model in its own process)."""
    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(start_server, *args, log_dir=log_dir) for args in arg_lists]
        servers = []
        errors = []
        for f in futures:
            try:
                servers.append(f.result())
            except RuntimeError as exc:
                errors.append(exc)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers
