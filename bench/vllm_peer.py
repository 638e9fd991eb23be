"""encode-server against vLLM's own encoder instance, side by side in one run, at the E's job.

The system an operator would run instead of encode-server is ``vllm serve`` as an EC producer:
``ECExampleConnector`` writes each image's encoder output to
``<dir>/<mm_hash>/encoder_cache.safetensors`` for a prefill worker to read. encode-server with
``--export-dir`` leaves the same layout. Both serve one checkpoint (a Qwen2.5-VL with a 6-block,
256-wide tower and a tiny language model, saved in bfloat16, built offline with a fixed seed by
``tests/vllm/tiny_qwen.py``), take the same 640x480 PNGs at the same concurrency, and each request
is done only once the file a prefill worker reads exists:

- vLLM's E answers an OpenAI chat whose image is a base64 ``data:`` URL with ``uuid`` = the image's
  BLAKE3 (so its file is found by that name), ``max_tokens=1``: what an EPD proxy sends it;
- encode-server answers ``POST /v1/encode`` with the same image as base64 JSON and
  ``"return": "metadata"`` (its file is written before it answers); a repeat is also measured the
  way encode-server's client and proxy send it, by hash alone.

Both servers run at once and the rounds alternate who goes first, so the load of a shared machine
falls on both alike. encode-server runs in the dtype vLLM's ``auto`` picks for this checkpoint
(bfloat16, which its own ``--dtype auto`` now picks too; the flag is given to say so), so both
produce the same tensor; the full run also measures encode-server in float32, its CPU default
before it followed vLLM's ``auto``.

Keys merged into ``bench/results/latest.json`` (``--out``): ``vs_vllm_unique`` and
``vs_vllm_repeat`` (encode-server's images/s over vLLM's E's: unique images, then the same images
again, uploaded again), ``vs_vllm_repeat_hash`` (the repeat as encode-server's client sends it),
``vs_vllm_rss`` (encode-server's peak resident memory over vLLM's, its whole process tree), and
``vs_vllm`` with the figures behind them (time until the file exists, p50 and p99). Plot:
``bench/results/vs_vllm.png``.

Run: ``make bench`` (after ``bench.serving``), or ``python -m bench.vllm_peer [--quick]``. It needs
the vLLM test environment (``make vllm-env``); ``--quick`` is what ``tests/vllm/test_bench_peer.py``
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import blake3
import httpx

from bench.latest import RESULTS, merge_into
from bench.rawhttp import Request, exchange
from bench.workload import photo_jpeg
from tests.server import ServerProcess, free_port, start_server

ROOT = Path(__file__).resolve().parent.parent
EXPORT_FILE = "encoder_cache.safetensors"
# The tower of the comparison (docs/benchmarks.md): 6 blocks, 256 wide (the language model stays tiny). Qwen's
# own pixel limits, so a 640x480 image is 391 rows, as with the real checkpoints.
TOWER = {"depth": 6, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "fullatt_block_indexes": [2, 5]}
MAX_PIXELS = 12_845_056
CONCURRENCY = 8
KEYS = ("vs_vllm_unique", "vs_vllm_repeat", "vs_vllm_repeat_hash", "vs_vllm_rss")
GOALS = {"vs_vllm_unique": ">= 1.3", "vs_vllm_repeat": ">= 5", "vs_vllm_repeat_hash": ">= 5", "vs_vllm_rss": "<= 0.5"}


@dataclass(frozen=True)
class Plan:
    rounds: int = 4
    images: int = 24  # unique images per round and server
    default_dtype: bool = True  # also encode-server in float32 (its CPU default before it followed vLLM's auto)
    # The checkpoint's max_pixels. vLLM's E encodes a dummy image of this size at start (an EC
    # producer measures its encoder's output width): 12.8 M pixels, 16k patches through full
    # attention, is 2.5 minutes on 2 cores, most of --quick's time. 1 M still leaves the 640x480
    # images unresized (391 rows).
    max_pixels: int = MAX_PIXELS


QUICK = Plan(rounds=2, images=4, default_dtype=False, max_pixels=1_003_520)


def vllm_env() -> Path:
    """The cached vLLM venv (built on first use, minutes): ``scripts/vllm_env.sh`` prints it."""
    out = subprocess.run([str(ROOT / "scripts" / "vllm_env.sh")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def build_checkpoint(env: Path, directory: Path, max_pixels: int = MAX_PIXELS) -> Path:
    """The checkpoint, saved by vLLM's own transformers (the one that must read it)."""
    code = (
        "import sys; from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl as make; "
        f"make(sys.argv[1], vision={TOWER!r}, dtype='bfloat16', max_pixels={max_pixels})"
    )
    subprocess.run([str(env / "bin" / "python"), "-c", code, str(directory)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    return directory


@dataclass
class Peer:
    """A server under test: where to send, where its files land, which process tree to measure."""

    name: str
    url: str
    export: Path
    pid: int
    route: ClassVar[str] = ""

    def body(self, image: bytes, mm_hash: str, *, by_hash: bool = False) -> dict[str, Any]:
        raise NotImplementedError


class EncodeServerPeer(Peer):
    route: ClassVar[str] = "/v1/encode"

    def body(self, image: bytes, mm_hash: str, *, by_hash: bool = False) -> dict[str, Any]:
        item = {"hash": mm_hash} if by_hash else {"data": base64.b64encode(image).decode("ascii")}
        return {"items": [item], "return": "metadata"}


@dataclass
class VllmPeer(Peer):
    model: str = ""
    route: ClassVar[str] = "/v1/chat/completions"

    def body(self, image: bytes, mm_hash: str, *, by_hash: bool = False) -> dict[str, Any]:
        url = "data:image/png;base64," + base64.b64encode(image).decode("ascii")
        part = {"type": "image_url", "image_url": {"url": url}, "uuid": mm_hash}
        content = [part, {"type": "text", "text": "describe the image"}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


@contextmanager
def vllm_encoder(env: Path, model: Path, export: Path, log_dir: Path) -> Iterator[VllmPeer]:
    """``vllm serve`` as an EC producer (the OpenAI server; the console script of the CPU build is
    broken, ``python -m`` takes the same flags), with vLLM's defaults for everything else."""
    port = free_port()
    config = {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
              "ec_connector_extra_config": {"shared_storage_path": str(export)}}
    cmd = [str(env / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
           "--limit-mm-per-prompt", '{"image": 1, "video": 0}', "--ec-transfer-config", json.dumps(config)]
    log = (log_dir / "vllm-e.log").open("wb")
    environ = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's E exited ({proc.returncode}); see {log_dir / 'vllm-e.log'}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's E did not start within 600 s")
            time.sleep(1)
        yield VllmPeer("vLLM E", url, export, proc.pid, model=str(model))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(10)
        log.close()


@contextmanager
def encode_server(model: Path, export: Path, log_dir: Path, dtype: str) -> Iterator[EncodeServerPeer]:
    args = ["--model", str(model), "--export-dir", str(export), "--grpc-port", "0"]
    server: ServerProcess = start_server(*args, *(["--dtype", dtype] if dtype else []), log_dir=log_dir, timeout=300)
    try:
        yield EncodeServerPeer(f"encode-server ({dtype or 'default dtype'})", server.url, export, server.proc.pid)
    finally:
        server.stop()


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants: vLLM's API server runs its engine core and worker as children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_memory_mb(pid: int, field: str) -> float:
    """A /proc status memory field (``VmHWM``: peak resident, ``VmRSS``: resident now) summed over the tree."""
    total = 0.0
    for p in _tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith(f"{field}:")),
                      0.0)
    return total


def tree_peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) summed over the process tree."""
    return tree_memory_mb(pid, "VmHWM")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process tree so far: where the cores went, which the load of a
    shared machine changes far less than it changes wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def _burst(peer: Peer, images: Sequence[tuple[bytes, str]], by_hash: bool) -> tuple[float, list[float]]:
    """All ``images`` at ``CONCURRENCY``: (wall seconds, per-image seconds until its file exists).

    The load generator shares the two cores with the servers, so its own cost is kept small and the
    same for both: every request body is made before the clock starts and goes out over a raw
    keep-alive HTTP/1.1 connection (``bench/rawhttp.py``). With httpx building each body as it went,
    the client cost more CPU per repeated image than encode-server did, and capped the repeat."""
    port = urlsplit(peer.url).port
    assert port is not None
    bodies = [(Request(peer.route, json.dumps(peer.body(image, mm_hash, by_hash=by_hash)).encode(),
                       accept="application/json"), mm_hash) for image, mm_hash in images]
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                request, mm_hash = queue.pop()
                started = time.perf_counter()
                status, answer = await asyncio.wait_for(exchange(reader, writer, request), 300)
                if status != 200:
                    raise RuntimeError(f"{peer.name}: {status} {answer[:300]!r}")
                path = peer.export / mm_hash / EXPORT_FILE
                while not path.exists():  # vLLM's producer may write after it answers: wait for the file
                    if time.perf_counter() - started > 30:
                        raise RuntimeError(f"{peer.name}: {path} did not appear")
                    await asyncio.sleep(0.001)
                latencies.append(time.perf_counter() - started)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started, latencies


def burst(peer: Peer, images: Sequence[tuple[bytes, str]], by_hash: bool = False) -> tuple[float, list[float]]:
    return asyncio.run(_burst(peer, images, by_hash))


def png_images(first_seed: int, n: int) -> list[tuple[bytes, str]]:
    """``n`` distinct 640x480 PNGs (photo-like content) and their BLAKE3 hex."""
    from PIL import Image

    out = []
    for seed in range(first_seed, first_seed + n):
        buf = io.BytesIO()
        Image.open(io.BytesIO(photo_jpeg(seed))).save(buf, format="PNG")
        out.append((buf.getvalue(), blake3.blake3(buf.getvalue()).hexdigest()))
    return out


def _pct(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compare(ours: Peer, theirs: Peer, plan: Plan, seed: int, *, repeats: bool = True) -> dict[str, Any]:
    """Interleaved rounds (who goes first alternates): unique images, then the same again."""
    tally: dict[str, dict[str, list[float]]] = {}

    def record(peer: Peer, kind: str, images: Sequence[tuple[bytes, str]], by_hash: bool = False) -> None:
        cpu = tree_cpu_seconds(peer.pid)
        wall, lat = burst(peer, images, by_hash)
        t = tally.setdefault(f"{peer.name}|{kind}", {"wall": [], "lat": [], "cpu": []})
        t["cpu"].append(tree_cpu_seconds(peer.pid) - cpu)
        t["wall"].append(wall)
        t["lat"] += lat

    for peer in (ours, theirs):  # warm-up: first requests pay one-off costs on both sides
        burst(peer, png_images(seed + 90_000, 2))
    for r in range(plan.rounds):
        images = png_images(seed + 1000 * r, plan.images)
        for peer in (ours, theirs) if r % 2 == 0 else (theirs, ours):
            record(peer, "unique", images)
            if repeats:
                record(peer, "repeat", images)
                if peer is ours:
                    record(peer, "repeat_hash", images, by_hash=True)
    out: dict[str, Any] = {}
    for key, t in tally.items():
        name, kind = key.split("|")
        n = plan.rounds * plan.images
        out.setdefault(name, {})[kind] = {
            "images_per_s": n / sum(t["wall"]),
            "available_p50_ms": _pct(t["lat"], 0.5),
            "available_p99_ms": _pct(t["lat"], 0.99),
            "cpu_ms_per_image": 1000 * sum(t["cpu"]) / n,
        }
    return out


def run(plan: Plan) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="encode-bench-vllm-"))
    started = time.perf_counter()
    env = vllm_env()
    model = build_checkpoint(env, work / "qwen2_5_vl-tower6x256-bf16", plan.max_pixels)
    detail: dict[str, Any] = {"model": "Qwen2.5-VL, tower 6 x 256 (out 64), tiny LM, bfloat16 checkpoint",
                              "images": "640x480 PNG, base64", "concurrency": CONCURRENCY,
                              "rounds": plan.rounds, "images_per_round": plan.images,
                              "max_pixels": plan.max_pixels}
    with vllm_encoder(env, model, work / "export-vllm", work) as theirs:
        with encode_server(model, work / "export-es", work, "bfloat16") as ours:
            detail.update(compare(ours, theirs, plan, seed=1))
            ours_rss = tree_peak_rss_mb(ours.pid)
        if plan.default_dtype:
            with encode_server(model, work / "export-es-default", work, "float32") as ours_default:
                default = compare(ours_default, theirs, Plan(2, plan.images), seed=500_000, repeats=False)
                detail[ours_default.name] = default[ours_default.name]
                detail["vLLM E (second comparison)"] = default[theirs.name]
        theirs_rss = tree_peak_rss_mb(theirs.pid)
    es, vl = detail[ours.name], detail[theirs.name]
    detail["rss_peak_mb"] = {ours.name: ours_rss, theirs.name: theirs_rss}
    result = {
        "vs_vllm_unique": es["unique"]["images_per_s"] / vl["unique"]["images_per_s"],
        "vs_vllm_repeat": es["repeat"]["images_per_s"] / vl["repeat"]["images_per_s"],
        "vs_vllm_repeat_hash": es["repeat_hash"]["images_per_s"] / vl["repeat"]["images_per_s"],
        "vs_vllm_rss": ours_rss / theirs_rss,
        "vs_vllm": detail,
    }
    detail["seconds"] = time.perf_counter() - started
    return result


def table(result: dict[str, Any]) -> str:
    d = result["vs_vllm"]
    lines = ["| figure | value | goal |", "|---|---|---|"]
    lines += [f"| {k} | {result[k]:.3g} | {GOALS[k]} |" for k in KEYS]
    lines += ["", "| server | kind | images/s | available p50 ms | p99 ms | CPU ms per image |",
              "|---|---|---|---|---|---|"]
    for name, kinds in d.items():
        if isinstance(kinds, dict) and "unique" in kinds:
            for kind, v in kinds.items():
                lines.append(f"| {name} | {kind} | {v['images_per_s']:.3g} | {v['available_p50_ms']:.1f} | "
                             f"{v['available_p99_ms']:.1f} | {v['cpu_ms_per_image']:.1f} |")
    lines += ["", *(f"peak RSS {name}: {mb:.0f} MiB" for name, mb in d["rss_peak_mb"].items())]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import bars

    d = result["vs_vllm"]
    es = next(k for k in d if k.startswith("encode-server (bfloat16"))
    ours, theirs = d[es], d["vLLM E"]
    fig, (a, b, c, e) = plt.subplots(1, 4, figsize=(16, 4))  # each panel its own scale; vLLM's E first in each
    bars(a, ["unique images"], {"vLLM E": [theirs["unique"]["images_per_s"]],
                                "encode-server": [ours["unique"]["images_per_s"]]},
         "images/s", f"unique images, concurrency {CONCURRENCY}")
    bars(b, ["the same images again"], {
        "vLLM E": [theirs["repeat"]["images_per_s"]],
        "encode-server, uploaded again": [ours["repeat"]["images_per_s"]],
        "encode-server, by hash": [ours["repeat_hash"]["images_per_s"]],
    }, "images/s", f"repeats, concurrency {CONCURRENCY}")
    bars(c, ["p50", "p99"], {
        "vLLM E": [theirs["unique"]["available_p50_ms"], theirs["unique"]["available_p99_ms"]],
        "encode-server": [ours["unique"]["available_p50_ms"], ours["unique"]["available_p99_ms"]],
    }, "ms", "unique image: until its file exists")
    rss = d["rss_peak_mb"]
    bars(e, ["peak RSS"], {"vLLM E": [rss["vLLM E"]], "encode-server": [rss[es]]}, "MiB",
         "resident memory (whole process tree)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small rounds: checks the code runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="merged into, keys replaced")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else Plan())
    merge_into(args.out, result)
    print(table(result))
    print(f"\nwrote {args.out} ({result['vs_vllm']['seconds']:.0f} s)")
    if not args.no_plots:
        print(f"wrote {plot(result, args.out.parent / 'vs_vllm.png')}")
    bad = [k for k in KEYS if not (result[k] > 0 and result[k] < float('inf'))]
    if bad:
        print(f"not finite: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
