"""The server the robustness tests share: started once per session (each start loads a model,
seconds on a busy 2-core box), ended by PID. Tests that need other flags start their own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import ServerProcess, start_server

# Short connection timeouts so the hostile-client tests finish in seconds; small limits so each
# one can be crossed cheaply.
ROBUST_ARGS = (
    "--header-timeout", "2", "--body-timeout", "2", "--keep-alive-timeout", "2", "--max-connections", "96",
    "--max-items", "8", "--max-request-bytes", str(4 * 1024 * 1024), "--max-image-pixels", str(4096 * 4096),
    "--max-wait-ms", "20", "--cache-mb", "64", "--request-timeout", "60",
)


@pytest.fixture(scope="session")
def robust_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("robust-logs")


@pytest.fixture(scope="session")
def robust_server(robust_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(*ROBUST_ARGS, log_dir=robust_logs)
    yield server
    assert server.stop() == 0, server.log()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} line")
