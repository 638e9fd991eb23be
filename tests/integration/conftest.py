from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
