"""External tools the operations tests need: found on PATH, or a loud failure naming the install."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest

__all__ = ["INSTALL_HINT", "require_tool", "wait_until"]

INSTALL_HINT = {
    "promtool": "apt-get install -y prometheus",
    "prometheus": "apt-get install -y prometheus",
    "docker-compose": "apt-get install -y docker-compose",
    "b3sum": "apt-get install -y b3sum",
}


def require_tool(name: str) -> str:
    """The tool's path. Missing is a failure, never a skip: `make test` installs these."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; run `make test` (it installs it) or: {INSTALL_HINT[name]}")
    return path


def wait_until(condition: Callable[[], object], what: str, seconds: float = 20.0) -> None:
    """Poll ``condition`` every 10 ms until it holds; an AssertionError naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.01)
