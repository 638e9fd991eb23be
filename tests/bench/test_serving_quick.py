"""``make bench``'s harness keeps working: ``python -m bench.serving --quick`` writes every key."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving import KEYS, flat

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_quick_bench_writes_every_key_finite(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serving", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in KEYS:
        assert key in result, key
    values = flat(result)
    assert not [k for k, v in values.items() if not math.isfinite(v)]
    for part in ("raw", "json"):
        for key in ("s1_overhead_ms", "s1_overhead_ms_vitb32", "s1_overhead_ms_clip_pooled"):
            assert f"{key}.{part}" in values
    assert {"local_ms", "redis_ms", "encode_ms"} <= set(result["s4_redis_vs_local"])
    for png in ("s1.png", "s2.png", "hits.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert "| s1_ratio |" in proc.stdout  # the table is printed
