from __future__ import annotations

import pytest

from tests.container.timings import TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.section("container: measured")
        for what, value in TIMINGS.items():
            terminalreporter.write_line(f"{what}: {value}")
