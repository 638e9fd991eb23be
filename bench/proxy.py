"""The latency encode-epd-proxy adds, against talking to vLLM directly: 64 concurrent streaming chats.

The stack of docs/vllm.md on loopback: Redis, encode-server and vLLM's OpenAI server as the
tower-free EC consumer (the tiny Qwen2.5-VL of tests/vllm/tiny_qwen.py, no --dtype on either side),
and ``encode-epd-proxy`` in its own process. Two kinds of chat, each sent both ways, the same work
for vLLM either way:

- ``image``: a chat with one image (8 distinct 112x84 PNGs, handed off once before, so the proxy's
  hand-off is the steady state: a hash-only hit). Through the proxy the client sends the pixels;
  directly, it sends vLLM the very body the proxy would (metadata + identifier), so the difference
  is the proxy: parsing, the hand-off round trip to encode-server, the rewrite, the relay;
- ``text``: a chat without images, the same body both ways: the relay alone.

Beside them, ``concurrency`` hand-offs at once straight to encode-server (the client's
``hand_off``, a hash-only hit): the share of the image chats' added latency that is encode-server's.

Each burst is ``concurrency`` streaming chats at once (``max_tokens`` 16, greedy, ``ignore_eos``),
the two paths alternating first; each chat's time to its first content token (TTFT) and to its
last byte are kept. The proxy's added latency is the difference of the percentiles (p50, p99) of
the two paths' distributions, per kind (a difference of percentiles, not of paired requests: the
p99 difference is noisy and may even be negative on a shared machine).

Keys merged into ``bench/results/latest.json`` (``--out``): ``proxy_added_ttft_p50_ms``,
``proxy_added_ttft_p99_ms``, ``proxy_added_total_p50_ms``, ``proxy_added_total_p99_ms`` (image
chats), and ``proxy`` with every figure behind them.

Run: ``make bench`` (after the others), or ``python -m bench.proxy [--quick]``. It needs the vLLM
test environment (``make vllm-env``). ``--vllm-url`` with ``--encoder-url`` uses a running
consumer and its encode-server instead of starting them (tests/vllm/test_bench_proxy.py runs the
quick form so against the vLLM suite's servers).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.latest import RESULTS, merge_into
from bench.proxy_cpu import ready_process
from bench.vllm_peer import vllm_env
from tests.server import free_port, start_server

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "bench-proxy"
KEYS = ("proxy_added_ttft_p50_ms", "proxy_added_ttft_p99_ms", "proxy_added_total_p50_ms", "proxy_added_total_p99_ms")


@dataclass(frozen=True)
class Plan:
    concurrency: int = 64
    rounds: int = 3
    max_tokens: int = 16


QUICK = Plan(concurrency=8, rounds=1, max_tokens=4)


def _png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(84, 112, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _chat(parts: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe the image"}]}]}


def _image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first content token, seconds to the last byte) of one streamed chat."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - started
    total = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url}: a stream without content")
    return first, total


async def _burst(url: str, bodies: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return list(await asyncio.gather(*(_one(client, url, b) for b in bodies)))


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _handoffs(encoder_url: str, images: Sequence[bytes], n: int) -> list[float]:
    """Seconds of each of ``n`` concurrent hand-offs of one image, straight to encode-server."""
    from encode_client import AsyncClient

    async with AsyncClient(encoder_url, response="json", lanes=16) as client:

        async def one(i: int) -> float:
            started = time.perf_counter()
            await client.hand_off([images[i % len(images)]])
            return time.perf_counter() - started

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def measure(plan: Plan, direct_url: str, proxy_url: str, encoder_url: str) -> dict[str, Any]:
    """Warm up, then ``plan.rounds`` bursts per kind and path; the figures."""
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request

    images = [_png(9000 + i) for i in range(8)]
    via_proxy = {"image": [_chat([_image_part(images[i % 8])], plan.max_tokens) for i in range(plan.concurrency)],
                 "text": [_chat([], plan.max_tokens) for _ in range(plan.concurrency)]}
    with Client(encoder_url, response="json", timeout=60) as client:
        direct = {"image": [rewrite_chat_request(b, client)[0] for b in via_proxy["image"]], "text": via_proxy["text"]}
    asyncio.run(_burst(proxy_url, via_proxy["image"][:8]))  # warm: every image handed off, every path open
    asyncio.run(_burst(direct_url, direct["image"][:8]))
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {k: {"direct": [], "proxy": []} for k in via_proxy}
    handoffs: list[float] = []
    for r in range(plan.rounds):
        for kind in via_proxy:
            order = [("direct", direct_url, direct[kind]), ("proxy", proxy_url, via_proxy[kind])]
            for path, url, bodies in order if r % 2 == 0 else order[::-1]:
                samples[kind][path] += asyncio.run(_burst(url, bodies))
        handoffs += asyncio.run(_handoffs(encoder_url, images, plan.concurrency))
    out: dict[str, Any] = {}
    for kind, paths in samples.items():
        figures: dict[str, Any] = {}
        for path, pairs in paths.items():
            for i, what in enumerate(("ttft", "total")):
                xs = [p[i] * 1000 for p in pairs]
                figures[f"{path}_{what}_p50_ms"] = _pct(xs, 0.5)
                figures[f"{path}_{what}_p99_ms"] = _pct(xs, 0.99)
        for what in ("ttft", "total"):
            for q in ("p50", "p99"):
                figures[f"added_{what}_{q}_ms"] = figures[f"proxy_{what}_{q}_ms"] - figures[f"direct_{what}_{q}_ms"]
        figures["chats_per_path"] = len(paths["proxy"])
        out[kind] = figures
    ms = [x * 1000 for x in handoffs]
    out["handoff"] = {"p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99), "calls": len(ms),
                      "what": f"{plan.concurrency} concurrent hand-offs of one cached image, straight to encode-server"}
    return out


@contextmanager
def proxy_process(vllm_url: str, encoder_url: str, log_dir: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "encode_client.proxy", "--listen", f"127.0.0.1:{port}", "--vllm", vllm_url,
           "--encoder", encoder_url, "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with ready_process(cmd, dict(os.environ), log_dir / "proxy.log", url + "/health"):
        yield url


@contextmanager
def epd_stack(work: Path, concurrency: int) -> Iterator[tuple[str, str]]:
    """Redis, encode-server and the tower-free vLLM consumer; (vLLM's URL, encode-server's URL)."""
    from tests.redis_procs import start_redis

    env = vllm_env()
    model = work / "tiny-qwen2_5_vl"
    code = "import sys; from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl as make; make(sys.argv[1])"
    subprocess.run([str(env / "bin" / "python"), "-c", code, str(model)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    with ExitStack() as stack:
        redis_proc = stack.enter_context(start_redis())
        server = start_server("--model", str(model), "--redis-url", redis_proc.url, "--cache-prefix", PREFIX,
                              "--grpc-port", "0", log_dir=work, timeout=300)
        stack.callback(server.stop)
        port = free_port()
        ec = {"ec_connector": "EncodeServerECConnector", "ec_connector_module_path": "encode_client.vllm_connector",
              "ec_role": "ec_consumer", "ec_connector_extra_config": {
                  "redis_url": redis_proc.url, "encoder_url": server.url, "prefix": PREFIX}}
        cmd = [str(env / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", "1024", "--max-num-seqs", str(concurrency),
               "--limit-mm-per-prompt", '{"image": 0, "video": 0}', "--ec-transfer-config", json.dumps(ec)]
        environ = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT / "clients" / "python")}
        log = stack.enter_context((work / "vllm.log").open("wb"))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
        stack.callback(lambda: (os.killpg(proc.pid, 15), proc.wait(60)) if proc.poll() is None else None)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; see {work / 'vllm.log'}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url, server.url


def run(plan: Plan, vllm_url: str | None = None, encoder_url: str | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="encode-bench-proxy-"))
    started = time.perf_counter()
    with ExitStack() as stack:
        if vllm_url is None or encoder_url is None:
            vllm_url, encoder_url = stack.enter_context(epd_stack(work, plan.concurrency))
        proxy_url = stack.enter_context(proxy_process(vllm_url, encoder_url, work))
        figures = measure(plan, vllm_url, proxy_url, encoder_url)
    image = figures["image"]
    detail = {"concurrency": plan.concurrency, "rounds": plan.rounds, "max_tokens": plan.max_tokens,
              "model": "tiny Qwen2.5-VL (tests/vllm/tiny_qwen.py), vLLM 0.32 CPU, tower-free consumer", **figures,
              "seconds": time.perf_counter() - started}
    return {
        "proxy_added_ttft_p50_ms": image["added_ttft_p50_ms"],
        "proxy_added_ttft_p99_ms": image["added_ttft_p99_ms"],
        "proxy_added_total_p50_ms": image["added_total_p50_ms"],
        "proxy_added_total_p99_ms": image["added_total_p99_ms"],
        "proxy": detail,
    }


def table(result: dict[str, Any]) -> str:
    d = result["proxy"]
    lines = [f"{d['concurrency']} concurrent streaming chats, {d['max_tokens']} tokens, "
             f"{d['image']['chats_per_path']} per path and kind",
             "| chat | path | TTFT p50 | TTFT p99 | total p50 | total p99 |", "|---|---|---|---|---|---|"]
    for kind in ("image", "text"):
        f = d[kind]
        for path in ("direct", "proxy", "added"):
            cells = [f"{f[f'{path}_{w}_{q}_ms']:.1f} ms" for w in ("ttft", "total") for q in ("p50", "p99")]
            name = path if path != "added" else "added by the proxy"
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    h = d["handoff"]
    lines.append(f"\nof which the hand-off: {h['what']}: p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small burst per path: checks the code runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json", help="merged into, keys replaced")
    parser.add_argument("--vllm-url", help="a running tower-free consumer (with --encoder-url): start none")
    parser.add_argument("--encoder-url", help="the encode-server that consumer reads from")
    args = parser.parse_args(argv)
    if (args.vllm_url is None) != (args.encoder_url is None):
        parser.error("give both --vllm-url and --encoder-url, or neither")
    result = run(QUICK if args.quick else Plan(), args.vllm_url, args.encoder_url)
    merge_into(args.out, result)
    print(table(result))
    print(f"\nwrote {args.out} ({result['proxy']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
