"""``make bench``'s video harness keeps working: ``python -m bench.video --quick`` merges every key,
each clip measured (a miss, then a hit), its stages split, its tokens and frames counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.video import KEYS, QUICK

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_quick_video_bench_merges_every_key(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    out.write_text(json.dumps({"s1_ratio": 1.5}))  # merged into, not replaced
    proc = subprocess.run([sys.executable, "-m", "bench.video", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["s1_ratio"] == 1.5
    names = {clip.name for clip in QUICK}
    for key in KEYS:
        assert set(result[key]) == names, key
    for name in names:
        clip = result["video_clips"][name]
        t, h, w = clip["grid_thw"]
        assert result["video_tokens"][name] == t * h * w // 4  # spatial merge 2 x 2
        assert result["video_frames"][name] == 4  # 2 s at 2 fps: vLLM's loader's minimum of 4
        assert 0 < result["video_hit_s_per_video_s"][name] < result["video_encode_s_per_video_s"][name]
        stages = result["video_stages"][name]
        assert all(stages[s] > 0 for s in ("decode", "patchify", "server_preprocess", "server_forward")), stages
        assert stages["server_preprocess"] + stages["server_forward"] < stages["encode_wall"]
    assert len(result["video_load_average"]["before"]) == 3
    assert "| 2s_160x120_mp4 |" in proc.stdout  # the table is printed
