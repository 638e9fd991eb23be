"""S1 and S2 on a GPU with a Qwen2.5-VL-7B-sized vision tower (random weights, real architecture,
bf16), printed as ``bench.serving`` prints them. Run by ``bench/gpu_check.sh`` (under 8 minutes).

S1: unique 640x480 JPEGs at concurrency 16 against the in-process pipeline on the same GPU, and
one request at a time (raw and JSON bodies) against the in-process batch-1 time. S2: hash-only
hits of 64, 576 and 2,500 tokens x 3,584 bf16 against the raw-wire server.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import models
from bench.serving import RESULTS, S2_TOKENS, Plan, s1, s2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--depth", type=int, default=None, help="fewer blocks (a smoke test off the GPU)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: bench/gpu_check.sh needs a GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    overrides = {"depth": args.depth, "fullatt_block_indexes": [args.depth - 1]} if args.depth else {}
    model = models.qwen25_vl_7b_vision_dir(**overrides)
    print(f"[{time.perf_counter() - started:5.0f} s] model at {model}", flush=True)
    dtype = "bfloat16"
    server = ["--model", str(model), "--device", args.device, "--dtype", dtype]
    logs = Path(tempfile.mkdtemp(prefix="encode-gpu-"))
    one = s1(str(model), server, 128, 30, 300_000, logs, device=args.device, dtype=dtype)
    print(f"[{time.perf_counter() - started:5.0f} s] S1 done", flush=True)
    two = s2(model, Plan(s2_requests=(300, 60, 20)), logs, server_args=["--device", args.device, "--dtype", dtype])
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    result = {
        "device": gpu,
        "s1_ratio": one["server_images_per_s"] / one["bare_images_per_s"],
        "s1_overhead_ms": {
            "raw": one["server_raw_p50_ms"] - one["bare_batch1_ms"],
            "json": one["server_json_p50_ms"] - one["bare_batch1_ms"],
        },
        "s2_ratio_safetensors": min(two[f"safetensors_{n}"]["ratio"] for n in S2_TOKENS),
        "s2_ratio_json": min(two[f"json_{n}"]["ratio"] for n in S2_TOKENS),
        "detail": {"s1": one, "s2": two},
        "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{gpu}, Qwen2.5-VL-7B-sized vision tower, bf16, {result['seconds']:.0f} s")
    print("| figure | value | goal |\n|---|---|---|")
    print(f"| s1_ratio | {result['s1_ratio']:.3g} | >= 0.95 |")
    for part in ("raw", "json"):
        print(f"| s1_overhead_ms.{part} | {result['s1_overhead_ms'][part]:.3g} | |")
    print(f"| bare images/s | {one['bare_images_per_s']:.1f} | |")
    print(f"| server images/s | {one['server_images_per_s']:.1f} | |")
    print(f"| s2_ratio_safetensors | {result['s2_ratio_safetensors']:.3g} | >= 0.8 |")
    print(f"| s2_ratio_json | {result['s2_ratio_json']:.3g} | |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
