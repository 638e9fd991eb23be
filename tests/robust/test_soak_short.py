"""The soak's short form (bench/soak.py, 60 s instead of 10 min): mixed load on HTTP and gRPC
with Redis paused once; memory, cache bytes, fds and threads flat; no 5xx."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import run_soak

pytestmark = pytest.mark.integration


def test_soak_60_seconds(robust_logs: Path) -> None:
    result = run_soak(60.0, clients=12, pause=12.0, log_dir=robust_logs)
    print(result.report())
    assert not result.failures, result.report()
    assert result.codes["200"] > 100 and result.codes["400"] > 0  # the mix really ran: goods and bads
    assert result.during_pause["200"] > 0, "nothing was served while Redis was paused"
    assert result.evictions > 0  # the cache budget was really under pressure
