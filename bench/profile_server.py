"""Where a request's time goes inside the server: py-spy samples a real server process while this
script sends one kind of traffic, then prints the functions that hold the most samples.

    python -m bench.profile_server upload-json   # unique images, JSON base64, one at a time
    python -m bench.profile_server upload-raw    # the same as raw bodies
    python -m bench.profile_server hit-json      # one cached image, uploaded again as JSON
    python -m bench.profile_server burst         # unique images, 16 concurrent
    python -m bench.profile_server burst-raw --gil --model builtin:zero   # raw bodies, 16 concurrent:
                                                 # what holds the GIL (the serving path's ceiling)

py-spy (``make install`` brings it) needs ptrace rights over the server: root, or
``kernel.yama.ptrace_scope=0``. ``--idle`` samples idle threads too (off: only on-CPU time).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.rawhttp import Conn, Request, post_many
from bench.serving import json_body, port_of
from bench.workload import photos
from tests.server import start_server


def traffic(kind: str, port: int, n: int) -> None:
    if kind.startswith("burst"):
        images = photos(5_000_000 + (kind == "burst-raw") * 100_000 + n, n)
        post_many(port, [Request("/v1/encode", d, "image/jpeg") if kind == "burst-raw" else
                         Request("/v1/encode", json_body(d)) for d in images], 16)
        return
    conn = Conn(port)
    if kind.startswith("hit"):
        data = photos(4_000_000, 1)[0]
        conn.post(Request("/v1/encode", data, "image/jpeg"))
        for _ in range(n):
            conn.post(Request("/v1/encode", json_body(data)))
    else:
        for data in photos(3_000_000 + (kind == "upload-raw") * 100_000, n):
            conn.post(Request("/v1/encode", data, "image/jpeg") if kind == "upload-raw"
                      else Request("/v1/encode", json_body(data)))
    conn.close()


def summarize(collapsed: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples; self time:"]
    lines += [f"  {100 * c / samples:5.1f}%  {f}" for f, c in own.most_common(top)]
    lines.append("inclusive:")
    lines += [f"  {100 * c / samples:5.1f}%  {f}" for f, c in total.most_common(top * 2)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("upload-json", "upload-raw", "hit-json", "burst", "burst-raw"))
    parser.add_argument("-n", type=int, default=150)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--gil", action="store_true", help="only samples of the thread holding the GIL")
    parser.add_argument("--server-arg", action="append", default=[], dest="server_args",
                        help="one more argument for the server (repeat it), e.g. --server-arg=--preprocess-processes=2")
    parser.add_argument("--model", default="builtin:tiny")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="encode-profile-"))
    server = start_server("--model", args.model, *args.server_args, log_dir=logs)
    out = logs / "profile.txt"
    try:
        traffic(args.kind, port_of(server), 5)  # warm-up, not sampled
        spy_bin = str(Path(sys.executable).parent / "py-spy")
        cmd = [spy_bin, "record", "-p", str(server.proc.pid), "-r", "250", "-f", "raw", "-o", str(out),
               "--threads", "--nonblocking"] + (["--idle"] if args.idle else []) + (["--gil"] if args.gil else [])
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        started = time.perf_counter()
        traffic(args.kind, port_of(server), args.n)
        took = time.perf_counter() - started
        spy.send_signal(2)
        spy.wait(30)
    finally:
        server.stop()
    print(f"{args.kind}: {args.n} requests in {took:.1f} s ({1000 * took / args.n:.1f} ms each)")
    print(summarize(out, args.top))


if __name__ == "__main__":
    main()
