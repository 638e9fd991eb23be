"""``make bench``'s side-by-side with vLLM's own encoder keeps working: ``python -m bench.vllm_peer
--quick`` starts vLLM's E (an EC producer) and encode-server on one checkpoint, and merges its keys
into an existing result without dropping the others.

Run here, in the vLLM suite, because it needs the vLLM environment that ``make test`` builds
beside the server's suite; the driver itself runs in the server's venv (``ENCODE_SERVER_PYTHON``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("vs_vllm_unique", "vs_vllm_repeat", "vs_vllm_repeat_hash", "vs_vllm_rss")


@pytest.mark.timeout(900)
def test_quick_peer_bench_merges_its_keys(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 0.9}))  # what bench.serving wrote before it
    python = os.environ.get("ENCODE_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    proc = subprocess.run([python, "-m", "bench.vllm_peer", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 0.9
    for key in KEYS:
        assert math.isfinite(result[key]) and result[key] > 0, key
    detail = result["vs_vllm"]
    assert detail["rss_peak_mb"]["vLLM E"] > 0
    for kind in ("unique", "repeat"):
        assert detail["vLLM E"][kind]["available_p99_ms"] >= detail["vLLM E"][kind]["available_p50_ms"] > 0
    assert (tmp_path / "vs_vllm.png").stat().st_size > 1000
    assert "| vs_vllm_unique |" in proc.stdout
