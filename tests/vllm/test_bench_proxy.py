"""``make bench``'s proxy latency keeps working: ``python -m bench.proxy --quick`` against the vLLM
suite's own tower-free consumer and encode-server, merging its keys into an existing result.

Run here because it needs the vLLM server this suite starts; the driver runs in the server's venv
(``ENCODE_SERVER_PYTHON``), the proxy in a process of its own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("proxy_added_ttft_p50_ms", "proxy_added_ttft_p99_ms", "proxy_added_total_p50_ms", "proxy_added_total_p99_ms")


@pytest.mark.timeout(600)
def test_quick_proxy_bench_merges_its_keys(
    tmp_path: Path, vllm_server: dict[str, Any], epd_server: ServerProcess
) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 0.9}))
    python = os.environ.get("ENCODE_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    cmd = [python, "-m", "bench.proxy", "--quick", "--out", str(out), "--vllm-url", vllm_server["url"],
           "--encoder-url", epd_server.url]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 0.9
    for key in KEYS:
        assert math.isfinite(result[key]), key
    for kind in ("image", "text"):
        figures = result["proxy"][kind]
        for path in ("direct", "proxy"):
            p50, p99, ttft = (figures[f"{path}_{k}_ms"] for k in ("total_p50", "total_p99", "ttft_p50"))
            assert p99 >= p50 >= ttft > 0
        assert figures["chats_per_path"] == 8
    handoff = result["proxy"]["handoff"]
    assert handoff["p99_ms"] >= handoff["p50_ms"] > 0 and handoff["calls"] == 8
    assert "| image | added by the proxy |" in proc.stdout
