"""64 concurrent 60 MiB uploads against one server, its memory read from /proc (docs/robustness.md).

A real ``encode-server`` process (built-in model, default limits: --max-request-bytes 64 MiB) is
started once per budget; 64 clients then upload at once, each a ~60 MiB body: raw, JSON base64
and multipart, of random bytes and of real noise PNGs (decoded: 20 megapixels each). Printed per
budget: the idle RSS, the peak RSS during the burst (VmHWM, reset just before it), the answers,
how fast refusals came (to the response head; a refused client stops sending there), and what is
held afterwards. ``--unbounded`` adds a run with the budget off (--max-inflight-mb 0), the
behaviour before the budget: it needs several GB of free memory.

    python -m bench.memory_burst [--budgets 512,2048] [--uploads 64] [--mb 60] [--unbounded]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.calls import metric
from tests.server import start_server
from tests.uploads import (
    MIB,
    Payload,
    RssSampler,
    mixed_payloads,
    rss_bytes,
    upload,
)


def burst(budget_mb: int, bodies: list[Payload], uploads: int, log_dir: Path) -> dict[str, object]:
    server = start_server("--max-inflight-mb", str(budget_mb), log_dir=log_dir)
    port = int(server.url.rsplit(":", 1)[1])
    pid = server.proc.pid
    try:
        time.sleep(1.0)
        idle = rss_bytes(pid)
        started = time.monotonic()
        with RssSampler(pid) as rss, ThreadPoolExecutor(uploads) as pool:
            futures = [
                pool.submit(upload, port, "/v1/encode", p.body, content_type=p.content_type, timeout=300)
                for p in (bodies[i % len(bodies)] for i in range(uploads))
            ]
            results = [f.result() for f in futures]
        elapsed = time.monotonic() - started
        answers = Counter(
            f"{r.status} {json.loads(r.body)['error']['type']}" if r.status and r.status != 200 and r.body
            else str(r.status) for r in results
        )
        refused = sorted(r.seconds for r in results if r.status == 503)
        # Refused from the declared length alone, before the body was read; the rest were refused
        # later (a decode or parse step found no room) after waiting their turn.
        unread = sorted(r.seconds for r in results if r.status == 503 and b"body was not read" in r.body)
        health = httpx.get(server.url + "/health", timeout=30).status_code
        deadline = time.monotonic() + 30
        while metric(server, "encode_server_inflight_bytes") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        return {
            "budget_mb": budget_mb,
            "idle_mb": idle / MIB,
            "peak_mb": rss.peak / MIB,
            "over_idle_mb": (rss.peak - idle) / MIB,
            "answers": dict(answers),
            "refusals": len(refused),
            "refused_unread": len(unread),
            "unread_s_median": statistics.median(unread) if unread else None,
            "unread_s_max": unread[-1] if unread else None,
            "refuse_s_median": statistics.median(refused) if refused else None,
            "refuse_s_max": refused[-1] if refused else None,
            "burst_s": elapsed,
            "inflight_after": metric(server, "encode_server_inflight_bytes"),
            "after_mb": rss_bytes(pid) / MIB,
            "health_after": health,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="512,2048", help="--max-inflight-mb values to run, comma-separated")
    parser.add_argument("--uploads", type=int, default=64)
    parser.add_argument("--mb", type=float, default=60.0, help="size of each upload in MiB")
    parser.add_argument("--unbounded", action="store_true", help="also run with the budget off (needs GBs)")
    args = parser.parse_args()
    bodies = mixed_payloads(int(args.mb * MIB))
    budgets = [int(b) for b in args.budgets.split(",")] + ([0] if args.unbounded else [])
    print(f"{args.uploads} concurrent uploads of {args.mb:g} MiB ({', '.join(sorted({p.kind for p in bodies}))})")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in budgets:
            row = burst(budget, bodies, args.uploads, Path(tmp))
            label = f"{budget} MiB" if budget else "off"
            print(
                f"budget {label}: idle {row['idle_mb']:.0f} MiB, peak {row['peak_mb']:.0f} MiB "
                f"(+{row['over_idle_mb']:.0f} MiB over idle), burst {row['burst_s']:.1f} s; "
                f"answers {row['answers']}; {row['refusals']} refused, "
                + (f"{row['refused_unread']} of them before the body was read (median "
                   f"{row['unread_s_median']:.2f} s / max {row['unread_s_max']:.2f} s to the answer), all refusals "
                   f"median {row['refuse_s_median']:.2f} s / max {row['refuse_s_max']:.2f} s; "
                   if row["refused_unread"] else "")
                + f"afterwards {row['inflight_after']:.0f} bytes in flight, RSS {row['after_mb']:.0f} MiB, "
                f"/health {row['health_after']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
