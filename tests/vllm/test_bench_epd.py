"""``make bench-epd`` keeps working: ``python -m bench.epd_system --quick`` starts each of the three
stacks (aggregated vLLM, vLLM's own EPD, encode-server's EPD), drives them with ``vllm bench serve``
and merges its keys into an existing result.

Run here because it needs the vLLM environment; the driver runs in the server's venv
(``ENCODE_SERVER_PYTHON``) and starts every process itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("sys_ttft_p50_vs_aggregated_popular_r1", "sys_ttft_p50_vs_vllm_epd_popular_r1",
        "sys_throughput_vs_aggregated_popular_r1")


@pytest.mark.timeout(900)
def test_quick_epd_system_bench_runs_every_stack_and_merges_its_keys(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 0.9}))
    python = os.environ.get("ENCODE_SERVER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    cmd = [python, "-m", "bench.epd_system", "--quick", "--out", str(out), "--plot", str(tmp_path / "p.png")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 0.9
    for key in KEYS:
        assert math.isfinite(result[key]) and result[key] > 0, key
    detail = result["epd_system"]
    runs = detail["runs"]
    assert set(runs) == {f"qwen7b/{s}/r1/popular" for s in ("aggregated", "vllm_epd", "encode_server")}
    images = detail["images"]["popular"]
    for key, figures in runs.items():
        assert figures["completed"] == 8 and figures["failed"] == 0, key
        assert figures["ttft_p99_ms"] >= figures["ttft_p50_ms"] > 0 and figures["throughput_rps"] > 0, key
    # Each distinct image went through a tower once, whichever stack: the encoders' own counts.
    for stack in ("vllm_epd", "encode_server"):
        assert runs[f"qwen7b/{stack}/r1/popular"]["tower_passes_per_request"] == images / 8, stack
    assert runs["qwen7b/aggregated/r1/popular"]["tower_passes_per_request"] is None  # vLLM counts none
    # Greedy texts are the aggregated stack's on every stack (their first words always; a whole text
    # may part at a near tie of the random checkpoint's logits, which the bench reports).
    same = detail["same_texts"]["qwen7b/r1/popular"]
    assert same["aggregated"] == {"texts": "8/8", "first_words": "8/8"}
    for stack in ("vllm_epd", "encode_server"):
        assert same[stack]["first_words"] == "8/8", (stack, same)
    for tag, procs in detail["stacks"].items():
        assert all(mb > 0 for mb in procs["peak_rss_mb"].values()), tag
    assert 0.2 < detail["tower_share"]["qwen7b"]["popular"] < 0.3
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "| qwen7b | 1 | popular | encode_server |" in proc.stdout
