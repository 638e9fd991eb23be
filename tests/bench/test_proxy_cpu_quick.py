"""``bench.proxy_cpu`` keeps working: a sample is put in the stage of its innermost marked frame
(a hand-off inside the app's request is the hand-off's, not the app's), and ``--quick`` merges the
proxy's CPU keys, every stage's among them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.proxy_cpu import STAGES, stage_of, stage_shares

APP = ("RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:409);"
       "ProxyApp._handle (encode_client/_proxy_app.py:280)")


def test_a_sample_goes_to_its_innermost_stage() -> None:
    assert stage_of(APP) == "serve"
    assert stage_of(APP + ";check_body (encode_client/_proxy_rewrite.py:70);loads (json/__init__.py:346)") == "parse"
    handoff = "prepare_body (encode_client/_proxy_rewrite.py:80);AsyncClient._send (encode_client/_client.py:240)"
    assert stage_of(APP + ";" + handoff) == "handoff"
    assert stage_of("Runner.run (asyncio/runners.py:118);ClientRequest.write_bytes (aiohttp/client_reqrep.py:1594)") \
        == "forward"
    assert stage_of("Runner.run (asyncio/runners.py:118)") == "loop"


def test_shares_add_up_over_every_stage() -> None:
    shares, count = stage_shares(f"{APP} 3\nRunner.run (asyncio/runners.py:118) 1\n")
    assert count == 4 and set(shares) == set(STAGES)
    assert shares["serve"] == 0.75 and shares["loop"] == 0.25


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_quick_proxy_cpu_bench_merges_its_keys(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 1.5}))  # merged into, not replaced
    proc = subprocess.run([sys.executable, "-m", "bench.proxy_cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 1.5
    assert result["epd_cpu_ms_proxy_image"] > 0 and result["epd_cpu_ms_proxy_text"] > 0
    for stage in STAGES:
        assert result[f"epd_cpu_ms_proxy_{stage}"] >= 0, stage
