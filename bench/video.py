"""What a video costs to encode: seconds of encode per second of video, frames sampled, tokens per
video, and where the time goes (decoding, resize + patchify, the forward pass).

A tiny Qwen3-VL checkpoint built offline (``tests/tiny_models.make_qwen3``, the server tests'
builder), H.264 mp4 and VP9 webm clips made with PyAV (``tests/videos.py``: frames with noise
everywhere, so the bitrate is high, ~37 Mbit/s at 640x480, and decoding is at its most expensive),
the real server (``--model DIR``, its own port, no Redis) over real HTTP, one clip at a time:

- the first encode of a clip (a miss: the file as a raw ``video/*`` body; probe, decode, resize,
  forward) and its repeat by hash (a hit), wall seconds per second of video;
- the server's own ``preprocess_seconds`` (decode + resize + patchify) and ``forward_seconds``
  sums over the miss, read from ``/metrics`` before and after;
- the same clip decoded and preprocessed in this process with the server's own functions
  (``encode_server.video.decode_frames``, the encoder's ``preprocess_video``), best of
  ``repeats``: the decode vs resize + patchify split the metrics do not give.

Keys merged into ``bench/results/latest.json`` (``--out``): ``video_encode_s_per_video_s`` and
``video_hit_s_per_video_s`` (per clip), ``video_tokens``, ``video_frames``,
``video_tokens_default_processor`` (the same clips counted with transformers' default
``Qwen3VLVideoProcessor`` sizes, by the server's own planner: what a hub checkpoint's settings
give, where the tiny one's small pixel budget shrinks the frames), ``video_stages`` (per
clip: seconds of ``decode``, ``patchify``, ``server_preprocess``, ``server_forward``),
``video_clips`` (what each clip is), ``video_load_average`` (1, 5, 15 min, before and after: the
machine is shared) and ``video_machine``.

Run: ``make bench`` or ``python -m bench.video`` (a few minutes on 2 cores); ``--quick`` runs two
small clips in seconds (the test's form: it checks the harness, not the speed).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.latest import RESULTS, merge_into
from tests import tiny_models
from tests.server import ServerProcess, start_server
from tests.videos import CONTAINERS, make_video

FPS = 2.0  # --video-fps: vLLM's loader's default sampling
# transformers' Qwen3VLVideoProcessor defaults (the tiny checkpoint's budget is 2 x 8 frames of 128x128).
DEFAULT_VIDEO = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "max_frames": 768}
MAX_BODY = 128 * 2**20  # the 60 s clip is ~70 MB: its frames are noise everywhere
KEYS = ("video_encode_s_per_video_s", "video_hit_s_per_video_s", "video_tokens", "video_frames", "video_stages")


@dataclass(frozen=True)
class Clip:
    name: str
    seconds: float
    width: int
    height: int
    fps: float
    codec: str = "libx264"

    @property
    def frames(self) -> int:
        return round(self.seconds * self.fps)


FULL = (
    Clip("10s_320x240_mp4", 10, 320, 240, 30),
    Clip("10s_640x480_mp4", 10, 640, 480, 30),
    Clip("60s_320x240_mp4", 60, 320, 240, 30),
    Clip("6s_320x240_webm", 6, 320, 240, 30, "libvpx-vp9"),
)
QUICK = (
    Clip("2s_160x120_mp4", 2, 160, 120, 10),
    Clip("2s_128x96_webm", 2, 128, 96, 10, "libvpx-vp9"),
)


def _metric_sums(server: ServerProcess) -> dict[str, float]:
    """The ``_sum`` of the server's preprocess and forward histograms."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    sums = {}
    for line in text.splitlines():
        for stage in ("preprocess_seconds", "forward_seconds"):
            if line.startswith(f"encode_server_{stage}_sum"):
                sums[stage] = float(line.split()[-1])
    return sums


def _post(server: ServerProcess, body: bytes | dict[str, Any], media_type: str = "") -> tuple[float, dict[str, Any]]:
    """One request: a raw body with its ``Content-Type``, or one JSON item."""
    started = time.perf_counter()
    if isinstance(body, bytes):
        r = httpx.post(server.url + "/v1/encode", content=body, headers={"Content-Type": media_type}, timeout=600)
    else:
        r = httpx.post(server.url + "/v1/encode", json={"items": [body]}, timeout=600)
    elapsed = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
    return elapsed, r.json()["items"][0]


def _in_process(encoder: Any, data: bytes, fps: float, repeats: int) -> dict[str, float]:
    """Decode and resize + patchify as the server does, best of ``repeats`` each; the frames sampled."""
    from encode_server.video import decode_frames, probe

    plan = encoder.plan_video(probe(data), fps)
    decode = patchify = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        frames = decode_frames(data, plan.indices)
        decoded = time.perf_counter()
        encoder.preprocess_video(frames, plan)
        decode = min(decode, decoded - started)
        patchify = min(patchify, time.perf_counter() - decoded)
    return {"decode": decode, "patchify": patchify, "frames": len(plan.indices)}


def run(clips: Sequence[Clip], repeats: int, log_dir: Path) -> dict[str, Any]:
    from encode_server.encoders import load_encoder
    from encode_server.video import probe

    started = time.monotonic()
    load_before = os.getloadavg()
    model = tiny_models.make_qwen3(log_dir / "qwen3_vl")
    longest = max(c.seconds for c in clips)
    encoder = load_encoder(str(model), device="cpu")
    default = load_encoder(str(tiny_models.make_qwen3(log_dir / "qwen3_vl_default", video=DEFAULT_VIDEO)), device="cpu")
    out: dict[str, dict[str, Any]] = {key: {} for key in (*KEYS, "video_clips", "video_tokens_default_processor")}
    server = start_server("--model", str(model), "--video-fps", str(FPS), "--max-video-seconds", str(longest + 1),
                          "--max-wait-ms", "1", "--request-timeout", "600", "--max-request-bytes", str(MAX_BODY),
                          log_dir=log_dir)
    try:
        for clip in clips:
            data = make_video(clip.frames, clip.fps, clip.width, clip.height, codec=clip.codec)
            before = _metric_sums(server)
            miss_s, item = _post(server, data, f"video/{CONTAINERS[clip.codec]}")
            after = _metric_sums(server)
            assert item["status"] == "encoded", item["status"]
            hit_s, hit = _post(server, {"hash": item["hash"], "modality": "video"})
            assert hit["status"] == "hit", hit["status"]
            grid = item["meta"]["video_grid_thw"]
            stages = _in_process(encoder, data, FPS, repeats)
            out["video_encode_s_per_video_s"][clip.name] = miss_s / clip.seconds
            out["video_hit_s_per_video_s"][clip.name] = hit_s / clip.seconds
            out["video_tokens"][clip.name] = item["num_tokens"]
            out["video_frames"][clip.name] = stages.pop("frames")
            out["video_tokens_default_processor"][clip.name] = default.plan_video(probe(data), FPS).num_tokens
            out["video_stages"][clip.name] = {
                **stages,
                "server_preprocess": after["preprocess_seconds"] - before["preprocess_seconds"],
                "server_forward": after["forward_seconds"] - before["forward_seconds"],
                "encode_wall": miss_s,
            }
            out["video_clips"][clip.name] = {**asdict(clip), "bytes": len(data),
                                             "mbit_per_s": len(data) * 8 / clip.seconds / 1e6, "grid_thw": grid}
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"server exited with {code}:\n{server.log()}")
    return {
        **out,
        "video_load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "video_machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "video_bench_seconds": time.monotonic() - started,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| clip | Mbit/s | frames | tokens (default processor) | encode s / video s | hit s / video s | "
             "decode s | patchify s | server forward s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, clip in result["video_clips"].items():
        stages = result["video_stages"][name]
        lines.append(
            f"| {name} | {clip['mbit_per_s']:.1f} | {result['video_frames'][name]} | {result['video_tokens'][name]} "
            f"({result['video_tokens_default_processor'][name]}) | "
            f"{result['video_encode_s_per_video_s'][name]:.3f} | {result['video_hit_s_per_video_s'][name]:.4f} | "
            f"{stages['decode']:.2f} | {stages['patchify']:.3f} | {stages['server_forward']:.3f} |"
        )
    load = result["video_load_average"]
    lines.append(f"\nload average (1, 5, 15 min) before {load['before']}, after {load['after']}; "
                 f"{result['video_machine']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small clips: checks the harness runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="merged into, keys replaced")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="video-bench-") as tmp:
        result = run(QUICK if args.quick else FULL, 1 if args.quick else 2, Path(tmp))
    merge_into(args.out, result)
    print(table(result))
    print(f"\nwrote {args.out} ({result['video_bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
