"""The serving path's own ceiling: a tower that costs nothing (``builtin:zero``), served through each
door at concurrency 16, beside the same tower run in this process, in one run.

With the tower free, what a server serves per second, and the CPU and the GIL it spends per
request, is the serving path alone: the door's parsing, hashing, the tiers, decoding (Pillow) and
the resize to the tower's input, the batcher, the answer's bytes. Unique photo-like 640x480 JPEGs
(``bench/workload.py``), every request one image, answered with 729 x 1,152 bfloat16 rows
(SigLIP so400m/384's; ``--model builtin:zero-qwen7b`` for Qwen2.5-VL-7B's 391 x 3,584).

Doors: ``raw`` (the JPEG as the body, a safetensors answer), ``multipart`` (one file part, a
safetensors answer), ``json`` (base64 in, base64 out), ``grpc`` (``Encode``, the rows as bytes).
The bare pipeline: this process decodes, resizes and "encodes" the same images in batches of 16
(``kinds.image_inputs`` + ``forward``), one thread, as ``bench/serving.py``'s.

Per door, rounds interleaved with the bare pipeline's (a shared machine's load falls on both):

- ``ceiling_images_per_s_<door>``: images per second, 16 requests in flight;
- ``ceiling_cpu_ms_<door>``: the server's CPU time (user + system, every thread, and its
  ``--preprocess-processes`` workers) per request;
- ``ceiling_gil_ms_<door>``: the time per request a thread of the server's process held its GIL
  (the one every request goes through; the workers have their own), from py-spy sampling it
  (``--gil``: only samples in which a thread holds it, at ``GIL_RATE`` Hz);
- ``ceiling_ratio_<door>``: the door's images per second over the bare pipeline's;
- ``ceiling_bare_images_per_s``, ``ceiling_bare_cpu_ms``: the bare pipeline's.

Run: ``python -m bench.ceiling`` (a step of ``make bench``; ``--quick`` for the test's few requests).
``bench/gpu_check.py`` runs it too, on the lent machine's cores; where py-spy is not there (or may
not attach), the GIL keys are left out and the rest is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import encode_server.encoders  # noqa: F401  (first: the process state the server runs in)
from bench.latest import RESULTS, merge_into
from bench.rawhttp import Request, post_many
from bench.serving import process_cpu_seconds
from bench.workload import photos
from encode_server.kinds import image_inputs
from tests.server import ServerProcess, start_server

__all__ = ["DOORS", "GIL_RATE", "KEYS", "py_spy", "run", "table"]

DOORS = ("raw", "multipart", "json", "grpc")
CONCURRENCY = 16
GIL_RATE = 500  # py-spy samples per second
MAX_PIXELS = 40_000_000
MAX_REQUEST_BYTES = 8 << 20  # a photo's JPEG, base64 in JSON, with room
KEYS = (
    *(f"ceiling_{what}_{door}" for door in DOORS for what in ("images_per_s", "cpu_ms", "gil_ms", "ratio")),
    "ceiling_bare_images_per_s", "ceiling_bare_cpu_ms",
)


def _multipart(data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"image.jpg\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode()
    return head + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _request(door: str, data: bytes) -> Request:
    if door == "raw":
        return Request("/v1/encode", data, "image/jpeg")
    if door == "multipart":
        body, content_type = _multipart(data)
        return Request("/v1/encode", body, content_type)
    body = json.dumps({"items": [{"data": base64.b64encode(data).decode("ascii")}]}).encode()
    return Request("/v1/encode", body, "application/json", accept="application/json")


def _grpc_many(port: int, images: Sequence[bytes], concurrency: int) -> float:
    """Every image as one ``Encode`` call, ``concurrency`` in flight on one channel; wall seconds."""
    import grpc

    from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
    from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc

    async def main() -> float:
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            stub = pb_grpc.EncoderStub(channel)
            pending = list(images)
            started = time.perf_counter()

            async def worker() -> None:
                while pending:
                    answer = await stub.Encode(pb.EncodeRequest(items=[pb.Item(data=pending.pop())]), timeout=120)
                    if answer.items[0].status != "encoded":
                        raise RuntimeError(f"gRPC Encode answered {answer.items[0].status}")

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - started

    return asyncio.run(main())


def _send(door: str, server: ServerProcess, images: Sequence[bytes]) -> float:
    if door == "grpc":
        assert server.grpc_port
        return _grpc_many(server.grpc_port, images, CONCURRENCY)
    wall, _ = post_many(int(server.url.rsplit(":", 1)[1]), [_request(door, d) for d in images], CONCURRENCY)
    return wall


@contextmanager
def gil_samples(pid: int, into: dict[str, float]) -> Iterator[None]:
    """``into["samples"]``: py-spy's samples of ``pid`` in which one of its threads held the GIL,
    over the block (``into["seconds"]``: how long it sampled). Sampled without stopping the
    process (``--nonblocking``)."""
    spy = py_spy()
    if spy is None:
        raise RuntimeError("no py-spy beside this Python nor on PATH (pip install py-spy)")
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        cmd = [spy, "record", "-p", str(pid), "-r", str(GIL_RATE), "-f", "raw", "-o", out.name, "--gil",
               "--nonblocking"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached
        if proc.poll() is not None:
            raise RuntimeError(f"py-spy could not sample the server: {proc.stderr.read().decode()[-500:]}"
                               " (it needs ptrace rights: root, or kernel.yama.ptrace_scope=0)")
        started = time.perf_counter()
        try:
            yield
        finally:
            into["seconds"] = time.perf_counter() - started
            proc.send_signal(2)
            proc.wait(60)
            text = Path(out.name).read_text()
    # raw format: one "frame;frame;... count" line per distinct stack
    into["samples"] = float(sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.strip()))


def py_spy() -> str | None:
    """py-spy's executable: beside this Python (a venv's), else on PATH (a ``--target`` install's bin)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _bare(encoder: Any, images: Sequence[bytes]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for the bare pipeline over ``images``."""
    cpu, started = time.process_time(), time.perf_counter()
    for i in range(0, len(images), CONCURRENCY):
        encoder.forward([image_inputs(encoder, d, max_pixels=MAX_PIXELS) for d in images[i : i + CONCURRENCY]])
    return time.perf_counter() - started, time.process_time() - cpu


def _measure(server: ServerProcess, door: str, images: Sequence[bytes], gil: bool) -> tuple[float, float, float]:
    """(images per second, server CPU ms per request, GIL ms per request: NaN without ``gil``)."""
    pid = server.proc.pid
    held: dict[str, float] = {}
    cpu0 = process_cpu_seconds(pid, children=True)
    with gil_samples(pid, held) if gil else nullcontext():
        wall = _send(door, server, images)
    cpu = process_cpu_seconds(pid, children=True) - cpu0
    gil_ms = 1000 * held["samples"] / GIL_RATE / len(images) if gil else math.nan
    return len(images) / wall, 1000 * cpu / len(images), gil_ms


def run(model: str, n_images: int, rounds: int, log_dir: Path, doors: Sequence[str] = DOORS,
        server_args: Sequence[str] = (), gil: bool = True, base: Path | None = None) -> dict[str, float]:
    """Every ``ceiling_*`` key (module docstring): ``rounds`` of (bare, each door) over
    ``n_images`` fresh images each, the median of the rounds' figures. ``doors`` and
    ``server_args`` (more flags for the server) are for trying a change: ``make bench`` runs all.
    ``gil`` False: no py-spy, no ``ceiling_gil_ms_*`` keys. ``base``: another checkout of the
    server (``git worktree add /tmp/base main``), served beside this one on the same images in
    the same rounds, the order alternating: a change's before and after in one run, under the
    same load; its figures come back as ``base:ceiling_*``."""
    from encode_server.encoders import load_encoder

    encoder = load_encoder(model, device="cpu")
    _bare(encoder, photos(900_000, CONCURRENCY))  # warm
    figures: dict[str, list[float]] = {
        key: [] for key in KEYS
        if key.startswith("ceiling_bare_") or (key.rsplit("_", 1)[1] in doors and (gil or "_gil_" not in key))
    }
    # A gRPC call reserves what receiving the largest message takes (four copies of
    # --max-request-bytes) before its message arrives: at the default 64 MiB, the 2 GiB request
    # budget holds 7 calls and the rest of 16 are refused (503); a photo's limit holds them all.
    args = ("--model", model, "--max-request-bytes", str(MAX_REQUEST_BYTES), *server_args)
    servers = {"": start_server(*args, log_dir=log_dir, timeout=300)}
    try:
        if base is not None:
            env = {"PYTHONPATH": f"{base}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
            servers["base:"] = start_server(*args, log_dir=log_dir, env=env, timeout=300, fresh=True)
            figures.update({f"base:{key}": [] for key in figures if not key.startswith("ceiling_bare_")})
        for server in servers.values():
            for door in doors:  # warm each door: connections, first-call paths
                _send(door, server, photos(910_000 + 100 * DOORS.index(door), CONCURRENCY))
        for r in range(rounds):
            wall, cpu = _bare(encoder, photos(1_000_000 * (r + 1), n_images))
            bare_rate = n_images / wall
            figures["ceiling_bare_images_per_s"].append(bare_rate)
            figures["ceiling_bare_cpu_ms"].append(1000 * cpu / n_images)
            for d, door in enumerate(doors):
                images = photos(1_000_000 * (r + 1) + 10_000 * (d + 1), n_images)
                order = list(servers.items())
                for prefix, server in order[::-1] if (r + d) % 2 else order:
                    rate, cpu_ms, gil_ms = _measure(server, door, images, gil)
                    figures[f"{prefix}ceiling_images_per_s_{door}"].append(rate)
                    figures[f"{prefix}ceiling_cpu_ms_{door}"].append(cpu_ms)
                    if gil:
                        figures[f"{prefix}ceiling_gil_ms_{door}"].append(gil_ms)
                    figures[f"{prefix}ceiling_ratio_{door}"].append(rate / bare_rate)
    finally:
        for server in servers.values():
            server.stop()
    return {key: statistics.median(values) for key, values in figures.items()}


def table(result: dict[str, float]) -> str:
    lines = ["| door | images/s | CPU ms / request | GIL ms / request | of bare |", "|---|---|---|---|---|"]
    for prefix in ("", "base:"):
        for door in (d for d in DOORS if f"{prefix}ceiling_ratio_{d}" in result):
            gil = result.get(f"{prefix}ceiling_gil_ms_{door}")
            lines.append(f"| {prefix}{door} | {result[f'{prefix}ceiling_images_per_s_{door}']:.0f} | "
                         f"{result[f'{prefix}ceiling_cpu_ms_{door}']:.2f} | "
                         f"{'-' if gil is None else f'{gil:.2f}'} | {result[f'{prefix}ceiling_ratio_{door}']:.2f} |")
    lines.append(f"| bare (in-process) | {result['ceiling_bare_images_per_s']:.0f} | "
                 f"{result['ceiling_bare_cpu_ms']:.2f} | - | 1 |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--model", default="builtin:zero", choices=("builtin:zero", "builtin:zero-qwen7b"))
    parser.add_argument("--images", type=int, default=192, help="images per door per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few requests: the harness, not the figures")
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    parser.add_argument("--server-arg", action="append", default=[], dest="server_args",
                        help="one more argument for the server (repeat it), e.g. --server-arg=--log-level=warning")
    parser.add_argument("--base", type=Path, help="another checkout's server beside this one (before/after); "
                        "its figures are printed, not merged")
    args = parser.parse_args(argv)
    n_images, rounds = (32, 1) if args.quick else (args.images, args.rounds)
    with tempfile.TemporaryDirectory(prefix="ceiling_") as logs:
        result = run(args.model, n_images, rounds, Path(logs), args.doors, args.server_args, base=args.base)
    merge_into(args.out, {k: v for k, v in result.items() if not k.startswith("base:")})
    print(table(result))
    print(f"{args.out}: {len(result)} ceiling_* keys merged ({args.model}, {n_images} images x {rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
