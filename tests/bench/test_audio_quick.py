"""``make bench``'s audio harness keeps working: ``python -m bench.audio --quick`` merges every key,
each file measured (a miss, then a hit), its stages split and its tokens counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.audio import KEYS, QUICK

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_quick_audio_bench_merges_every_key(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 1.5}))  # merged into, not replaced
    proc = subprocess.run([sys.executable, "-m", "bench.audio", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 1.5
    names = {name for name, *_ in QUICK}
    for key in KEYS:
        assert set(result[key]) == names, key
    for name, seconds, *_ in QUICK:
        # Qwen2-Audio: 25 rows a second of audio (16 kHz, hop 160, two strides of 2)
        assert result["audio_tokens"][name] == int(seconds * 25)
        assert 0 < result["audio_hit_s_per_audio_s"][name] < result["audio_encode_s_per_audio_s"][name]
        assert all(result["audio_stages"][name][s] > 0 for s in ("decode", "features", "forward"))
