"""``make bench``'s ceiling step keeps working: every ``ceiling_*`` key, finite, for every door."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ceiling import DOORS, KEYS

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_quick_ceiling_writes_every_key_for_every_door(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    proc = subprocess.run([sys.executable, "-m", "bench.ceiling", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(KEYS) <= set(result)
    assert all(math.isfinite(result[k]) and result[k] >= 0 for k in KEYS)
    for door in DOORS:  # each door served images, spent CPU and held the GIL for them
        assert result[f"ceiling_images_per_s_{door}"] > 0 and result[f"ceiling_cpu_ms_{door}"] > 0
        assert result[f"ceiling_gil_ms_{door}"] > 0, door
        assert f"| {door} |" in proc.stdout
