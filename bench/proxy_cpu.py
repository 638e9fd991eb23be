"""What ``encode-epd-proxy`` itself costs: CPU milliseconds per request, in all and by stage.

CPU time, not wall-clock: it stays put when other work shares the machine's cores, and it is what
a deployment pays per request (at 1,000 requests/s each millisecond is a core). The stack is
small and needs no vLLM: Redis, encode-server (the built-in model, so an image's hand-off is a
hash-only hit after the warm-up), the scripted vLLM of ``tests/proxy_upstream.py`` in its own
process (a role chunk, ``max_tokens`` content chunks and ``[DONE]``, each its own HTTP chunk, as
vLLM streams them) and the proxy in its own process. Bursts of ``concurrency`` streaming chats:

- ``image``: one of 8 cached images per chat (the hand-off a hit), a 16-token streamed answer;
- ``text``: no media: the parse, the forward and the relay alone.

The proxy's user + system CPU is read from ``/proc/PID/stat`` around each kind's bursts, divided
by the chats. Then py-spy samples the proxy through one more round of image chats and each sample
is put in the stage of the innermost of these frames on its stack: ``parse``
(``check_body``), ``handoff`` (the encode-server call: the client's ``hand_off`` and what it
awaits), ``rewrite`` (the rest of ``prepare_body``: the plan, the new body, its JSON), ``forward``
(``Forwarder.send``: vLLM's request and its headers), ``relay`` (the answer's bytes, from vLLM's
socket to the client's), ``serve`` (uvicorn reading requests and the ASGI app's own work) and ``loop`` (the event
loop, GC, anything else). A stage's key is its share of the samples times the image chats' CPU
per request.

``--base PATH`` runs the same load against the proxy of another checkout too (its
``clients/python``), alternating, in the same run: a change's before and after on one machine.

Keys merged into ``bench/results/latest.json``: ``epd_cpu_ms_proxy_image``,
``epd_cpu_ms_proxy_text`` and ``epd_cpu_ms_proxy_<stage>``, with ``proxy_cpu`` holding every
figure (the base's under ``base``). Run: ``python -m bench.proxy_cpu [--quick] [--base PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.latest import RESULTS, merge_into
from bench.serving import process_cpu_seconds
from tests.server import free_port, start_server

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "bench-proxy-cpu"
STAGES = ("parse", "handoff", "rewrite", "forward", "relay", "serve", "loop")
# (stage, a frame's function name, a part of its file's path): the innermost match on a stack wins
_MARKERS: tuple[tuple[str, str, str], ...] = (
    ("parse", "check_body", "_proxy_rewrite"),
    ("handoff", "_send", "encode_client/_client"),
    ("handoff", "_run", "encode_client/_client"),
    ("handoff", "model", "encode_client/_client"),
    ("rewrite", "prepare_body", "_proxy_rewrite"),
    ("forward", "send", "_proxy_forward"),
    ("forward", "_send", "_proxy_forward"),
    ("forward", "write_bytes", "aiohttp/client_reqrep"),
    ("relay", "read_head", "_proxy_forward"),
    ("relay", "_relay", "_proxy_forward"),
    ("relay", "release", "_proxy_forward"),
    ("relay", "__call__", "starlette/responses"),
    ("relay", "wrap", "starlette/responses"),
    ("relay", "stream_response", "starlette/responses"),
    ("relay", "data_received", "aiohttp/client_proto"),
    ("serve", "run_asgi", "uvicorn"),
    ("serve", "data_received", "uvicorn"),
)


@dataclass(frozen=True)
class Plan:
    concurrency: int = 64
    rounds: int = 4
    max_tokens: int = 16
    profile_rounds: int = 3


QUICK = Plan(concurrency=8, rounds=1, max_tokens=4, profile_rounds=1)


def _image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _chat(parts: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": "stub", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe the image"}]}]}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        data = await r.aread()
        if r.status_code != 200 or not data.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{url}: {r.status_code} {data[:300]!r}")


async def _bursts(url: str, bodies: Sequence[dict[str, Any]], rounds: int) -> None:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        for _ in range(rounds):
            await asyncio.gather(*(_one(client, url, b) for b in bodies))


def stage_of(stack: str) -> str:
    """The stage of one py-spy raw sample's stack (``frame;frame;...``, outermost first), each frame
    ``function (path:line)``."""
    for frame in reversed(stack.split(";")):
        match = re.match(r"(\S+) \((.*?):\d+\)", frame.strip())
        if match is None:
            continue
        function, path = match.groups()
        function = function.rpartition(".")[2]
        for stage, name, where in _MARKERS:
            if function == name and where in path:
                return stage
    return "loop"


def stage_shares(raw: str) -> tuple[dict[str, float], int]:
    """Each stage's share of py-spy's samples (``-f raw``: ``stack count`` per line), and the count."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stage_of(stack)] += int(n)
    total = sum(counts.values())
    return {s: counts[s] / total if total else 0.0 for s in STAGES}, total


@contextmanager
def ready_process(cmd: list[str], env: dict[str, str], log: Path, ready: str) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` started (in the repository, its output into ``log``) once ``ready`` answers 200;
    terminated when the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(ready, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:4]} did not start; see {log}")
                time.sleep(0.2)
            yield proc
        finally:
            proc.terminate()
            proc.wait(60)


_UPSTREAM = """
import sys, time
from tests.proxy_upstream import StubVllm
stub = StubVllm(tokens=int(sys.argv[1]))
with stub:
    print(stub.url, flush=True)
    while True:
        time.sleep(3600)
"""


@contextmanager
def stand_in_vllm(tokens: int, log: Path) -> Iterator[str]:
    """The scripted vLLM in its own process (its CPU is not the proxy's); its URL."""
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _UPSTREAM, str(tokens)], stdout=subprocess.PIPE, stderr=err,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert proc.stdout is not None
            yield proc.stdout.readline().decode().strip()
        finally:
            proc.terminate()
            proc.wait(60)


@contextmanager
def proxy_process(checkout: Path, vllm_url: str, encoder_url: str, log: Path) -> Iterator[tuple[str, int]]:
    """``encode-epd-proxy`` from ``checkout``'s client; (its URL, its pid)."""
    port = free_port()
    cmd = [sys.executable, "-m", "encode_client.proxy", "--listen", f"127.0.0.1:{port}", "--vllm", vllm_url,
           "--encoder", encoder_url, "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(checkout / "clients" / "python")}
    url = f"http://127.0.0.1:{port}"
    with ready_process(cmd, env, log, url + "/health") as proc:
        yield url, proc.pid


def _cpu_per_chat(pid: int, url: str, bodies: Sequence[dict[str, Any]], rounds: int) -> float:
    before = process_cpu_seconds(pid)
    asyncio.run(_bursts(url, bodies, rounds))
    return (process_cpu_seconds(pid) - before) * 1000 / (len(bodies) * rounds)


def _profile(
    pid: int, url: str, bodies: Sequence[dict[str, Any]], rounds: int, out: Path
) -> tuple[dict[str, float], int]:
    cmd = [str(ROOT / ".venv" / "bin" / "py-spy"), "record", "--nonblocking", "-r", "250", "-p", str(pid), "-f",
           "raw", "-o", str(out)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attached
    asyncio.run(_bursts(url, bodies, rounds))
    spy.send_signal(signal.SIGINT)
    spy.wait(60)
    return stage_shares(out.read_text() if out.exists() else "")


def measure(plan: Plan, checkouts: dict[str, Path]) -> dict[str, Any]:
    from tests.images import image_bytes
    from tests.redis_procs import start_redis

    work = Path(tempfile.mkdtemp(prefix="encode-bench-proxy-cpu-"))
    images = [image_bytes("PNG", 112, 84, seed=9000 + i) for i in range(8)]
    bodies = {"image": [_chat([_image_part(images[i % 8])], plan.max_tokens) for i in range(plan.concurrency)],
              "text": [_chat([], plan.max_tokens) for _ in range(plan.concurrency)]}
    with ExitStack() as stack:
        redis_proc = stack.enter_context(start_redis())
        server = start_server("--redis-url", redis_proc.url, "--cache-prefix", PREFIX, log_dir=work)
        stack.callback(server.stop)
        vllm_url = stack.enter_context(stand_in_vllm(plan.max_tokens, work / "upstream.log"))
        proxies = {name: stack.enter_context(proxy_process(path, vllm_url, server.url, work / f"proxy-{name}.log"))
                   for name, path in checkouts.items()}
        for url, _ in proxies.values():  # warm: every image handed off, every pool open
            asyncio.run(_bursts(url, bodies["image"], 1))
            asyncio.run(_bursts(url, bodies["text"], 1))
        samples: dict[str, dict[str, list[float]]] = {n: {"image": [], "text": []} for n in proxies}
        for r in range(plan.rounds):
            order = list(proxies.items())
            for name, (url, pid) in order if r % 2 == 0 else order[::-1]:
                for kind in ("image", "text"):
                    samples[name][kind].append(_cpu_per_chat(pid, url, bodies[kind], 1))
        out: dict[str, Any] = {}
        for name, (url, pid) in proxies.items():
            shares, count = _profile(pid, url, bodies["image"], plan.profile_rounds, work / f"profile-{name}.txt")
            image = sorted(samples[name]["image"])[len(samples[name]["image"]) // 2]
            out[name] = {
                "image_ms": image, "text_ms": sorted(samples[name]["text"])[len(samples[name]["text"]) // 2],
                "image_rounds_ms": samples[name]["image"], "text_rounds_ms": samples[name]["text"],
                "stages_ms": {s: shares[s] * image for s in STAGES}, "samples": count,
            }
    return out


def run(plan: Plan, base: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    checkouts = {"main": ROOT, **({"base": base.resolve()} if base is not None else {})}
    figures = measure(plan, checkouts)
    main = figures["main"]
    result: dict[str, Any] = {"epd_cpu_ms_proxy_image": main["image_ms"], "epd_cpu_ms_proxy_text": main["text_ms"]}
    result.update({f"epd_cpu_ms_proxy_{s}": main["stages_ms"][s] for s in STAGES})
    result["proxy_cpu"] = {"concurrency": plan.concurrency, "rounds": plan.rounds, "max_tokens": plan.max_tokens,
                           "upstream": "tests/proxy_upstream.py StubVllm", **figures,
                           "seconds": time.perf_counter() - started}
    return result


def table(result: dict[str, Any]) -> str:
    d = result["proxy_cpu"]
    names = [n for n in ("base", "main") if n in d]
    lines = [f"proxy CPU ms per streamed chat ({d['concurrency']} at once, {d['max_tokens']} tokens, "
             f"median of {d['rounds']} bursts)", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append("| image chat (hit) | " + " | ".join(f"{d[n]['image_ms']:.2f}" for n in names) + " |")
    lines.append("| text chat | " + " | ".join(f"{d[n]['text_ms']:.2f}" for n in names) + " |")
    for s in STAGES:
        lines.append(f"| image: {s} | " + " | ".join(f"{d[n]['stages_ms'][s]:.2f}" for n in names) + " |")
    lines.append("| py-spy samples | " + " | ".join(str(d[n]["samples"]) for n in names) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small burst: checks the code runs")
    parser.add_argument("--base", type=Path, help="another checkout whose proxy runs beside this one's")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="merged into, keys replaced")
    args = parser.parse_args(argv)
    result = run(QUICK if args.quick else Plan(), args.base)
    merge_into(args.out, result)
    print(table(result))
    print(f"\nwrote {args.out} ({result['proxy_cpu']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
