"""What an audio file costs to encode: seconds of encode per second of audio, tokens per file, and
where the time goes (decoding, resampling, log-mel features, the forward pass).

A tiny Qwen2-Audio checkpoint built offline (``tests/tiny/qwen2_audio.py``: the real feature
extractor, 128 mel bins at 16 kHz, a 2-layer tower), files made with the standard library and PyAV
(``tests/audios.py``), the real server (``--model DIR``, its own port, no Redis) over real HTTP,
one file at a time:

- the first encode of a file (a miss: the file as a raw ``audio/*`` body; probe, decode,
  resample, featurise, forward) and its repeat by hash (a hit), wall seconds per second of audio;
- the same file decoded, resampled and featurised in this process with the server's own functions
  (``encode_server.audio.decode``, ``encoders.resample.resample``, the encoder's
  ``preprocess_audio``), best of ``repeats``, and one lone forward pass: the split.

Qwen2-Audio reads 30 s of a file at most (vLLM cuts there), so a longer file costs what 30 s do:
the server decodes only what the family reads. Every item is the same forward pass (3,000 mel
frames, 1,500 positions), so a real tower adds a fixed cost per item, not per second.

Keys merged into ``bench/results/latest.json`` (``--out``): ``audio_encode_s_per_audio_s`` and
``audio_hit_s_per_audio_s`` (per file), ``audio_tokens``, ``audio_stages`` (per file: seconds of
``decode``, ``resample``, ``features``, ``forward``), ``audio_files``, ``audio_load_average``.

Run: ``make bench`` or ``python -m bench.audio`` (about a minute on 2 cores); ``--quick`` runs two
short files (the harness, not the speed: ``tests/bench/test_audio_quick.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.latest import RESULTS, merge_into
from tests.audios import make_audio
from tests.server import start_server
from tests.tiny.qwen2_audio import make_tiny_qwen2_audio

# (name, seconds, rate, channels, format)
FILES = [
    ("10s-16k-wav", 10.0, 16_000, 1, "wav"), ("30s-44k-stereo-flac", 30.0, 44_100, 2, "flac"),
    ("60s-44k-mp3", 60.0, 44_100, 2, "mp3"), ("120s-16k-wav", 120.0, 16_000, 1, "wav"),
]
QUICK = [("2s-16k-wav", 2.0, 16_000, 1, "wav"), ("3s-44k-flac", 3.0, 44_100, 1, "flac")]
KEYS = ("audio_encode_s_per_audio_s", "audio_hit_s_per_audio_s", "audio_tokens", "audio_stages", "audio_files")


def _best(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def stages(checkpoint: Path, data: bytes, repeats: int) -> dict[str, float]:
    """Decode, resample, features and one forward pass of ``data``, in this process (best of ``repeats``)."""
    import math

    from encode_server.audio import decode, probe
    from encode_server.encoders import load_encoder
    from encode_server.encoders.resample import resample

    encoder = load_encoder(str(checkpoint), dtype="float32")
    info = probe(data)
    plan = encoder.plan_audio(info)
    keep = math.ceil((plan.keep_seconds or 1e9) * info.sample_rate)
    decode_s, (waveform, rate) = _best(lambda: decode(data, max_samples=10**9, keep_samples=keep), repeats)
    resample_s, _ = _best(lambda: resample(waveform, rate, plan.sample_rate), repeats)
    prepare_s, prepared = _best(lambda: encoder.preprocess_audio(waveform, rate), repeats)
    forward_s, _ = _best(lambda: encoder.forward([prepared]), repeats)
    return {"decode": decode_s, "resample": resample_s, "features": max(0.0, prepare_s - resample_s),
            "forward": forward_s}


def run(files: list[tuple[str, float, int, int, str]], repeats: int, log_dir: Path) -> dict[str, Any]:
    checkpoint = make_tiny_qwen2_audio(log_dir / "tiny-qwen2-audio")
    load_before = os.getloadavg()
    server = start_server("--model", str(checkpoint), "--grpc-port", "0", "--dtype", "float32",
                          "--max-audio-seconds", "600", log_dir=log_dir)
    out: dict[str, Any] = {"audio_encode_s_per_audio_s": {}, "audio_hit_s_per_audio_s": {}, "audio_tokens": {},
                           "audio_stages": {}, "audio_files": {}}
    try:
        for name, seconds, rate, channels, fmt in files:
            data = make_audio(seconds, rate, channels, fmt, seed=len(name))
            started = time.perf_counter()
            r = httpx.post(server.url + "/v1/encode", content=data, headers={"Content-Type": f"audio/{fmt}"},
                           timeout=300)
            miss = time.perf_counter() - started
            assert r.status_code == 200, r.text
            item = r.json()["items"][0]
            started = time.perf_counter()
            hit = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": item["hash"], "modality": "audio"}]},
                             timeout=60)
            hit_s = time.perf_counter() - started
            assert hit.json()["items"][0]["status"] == "hit"
            out["audio_encode_s_per_audio_s"][name] = miss / seconds
            out["audio_hit_s_per_audio_s"][name] = hit_s / seconds
            out["audio_tokens"][name] = item["num_tokens"]
            out["audio_stages"][name] = stages(checkpoint, data, repeats)
            out["audio_files"][name] = {"seconds": seconds, "rate": rate, "channels": channels, "format": fmt,
                                        "bytes": len(data)}
            print(f"{name}: {miss:.3f} s ({miss / seconds:.4f} s per s of audio), {item['num_tokens']} tokens, "
                  f"hit {hit_s * 1000:.1f} ms; stages {out['audio_stages'][name]}", flush=True)
    finally:
        server.stop()
    out["audio_load_average"] = {"before": load_before, "after": os.getloadavg()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short files: the harness, not the speed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="merged into, keys replaced")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-audio-") as tmp:
        results = run(QUICK if args.quick else FILES, 1 if args.quick else args.repeats, Path(tmp))
    merge_into(args.out, results)
    print(f"merged {len(results)} keys into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
