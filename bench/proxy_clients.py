"""Which HTTP client the proxy should send vLLM its requests with: CPU per streamed request.

Each candidate sends the same load to the scripted vLLM of ``tests/proxy_upstream.py`` (in its own
process): bursts of ``concurrency`` streaming POSTs over pooled keep-alive connections, every
answer's bytes read as they come (what the proxy's relay does). This process's CPU per request
(``time.process_time``) is the client's cost: the upstream's is another process's.

- ``httpx``: as the proxy used it, 16 pools used in turn (``_lanes``);
- ``httpx+sniffio``: the same with ``sniffio`` importable (httpcore 1.0 imports it on every
  request and every close; without it each is a failed import: a scan of ``sys.path``);
- ``aiohttp``: one ``ClientSession``, its ``TCPConnector`` pooling keep-alive connections;
- ``raw``: asyncio streams and httptools' parser over a list of idle connections: the floor a
  hand-written client could reach.

Run: ``python -m bench.proxy_clients [--quick]``; prints a table, writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import types
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from bench.proxy_cpu import stand_in_vllm

BODY = json.dumps({"model": "stub", "stream": True, "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
Send = Callable[[], Awaitable[int]]


async def _httpx(url: str, concurrency: int) -> tuple[Send, Callable[[], Awaitable[None]]]:
    import httpx
    from encode_client._lanes import AsyncLanes

    lanes = AsyncLanes(16, timeout=60, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024,
                                                          keepalive_expiry=2.0))

    async def send() -> int:
        http = lanes.next()
        answer = await http.send(http.build_request("POST", url + "/v1/chat/completions", content=BODY,
                                                    headers={"content-type": "application/json"}), stream=True)
        n = 0
        async for chunk in answer.aiter_raw():
            n += len(chunk)
        await answer.aclose()
        return n

    return send, lanes.aclose


async def _aiohttp(url: str, concurrency: int) -> tuple[Send, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
                                    timeout=aiohttp.ClientTimeout(sock_read=60, sock_connect=5),
                                    auto_decompress=False)

    async def send() -> int:
        async with session.post(url + "/v1/chat/completions", data=BODY,
                                headers={"content-type": "application/json"}) as answer:
            n = 0
            async for chunk in answer.content.iter_any():
                n += len(chunk)
            return n

    return send, session.close


async def _raw(url: str, concurrency: int) -> tuple[Send, Callable[[], Awaitable[None]]]:
    import httptools

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (parts.netloc.encode(), len(BODY)))

    class Sink:
        def __init__(self) -> None:
            self.n, self.done = 0, False

        def on_body(self, body: bytes) -> None:
            self.n += len(body)

        def on_message_complete(self) -> None:
            self.done = True

    async def send() -> int:
        reader, writer = idle.pop() if idle else await asyncio.open_connection(host, port)
        writer.write(head + BODY)
        sink = Sink()
        parser = httptools.HttpResponseParser(sink)
        while not sink.done:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("closed")
            parser.feed_data(data)
        idle.append((reader, writer))
        return sink.n

    async def close() -> None:
        for _, writer in idle:
            writer.close()

    return send, close


async def _run(make: Callable[[str, int], Awaitable[tuple[Send, Callable[[], Awaitable[None]]]]], url: str,
               concurrency: int, rounds: int) -> float:
    send, close = await make(url, concurrency)
    try:
        await asyncio.gather(*(send() for _ in range(concurrency)))  # warm: the pool filled
        started = time.process_time()
        for _ in range(rounds):
            sizes = await asyncio.gather(*(send() for _ in range(concurrency)))
            assert all(sizes), sizes
        return (time.process_time() - started) * 1000 / (concurrency * rounds)
    finally:
        await close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    concurrency, rounds, repeats = (8, 2, 1) if args.quick else (64, 8, 3)
    work = Path(tempfile.mkdtemp(prefix="encode-bench-proxy-clients-"))
    results: dict[str, list[float]] = {}
    with stand_in_vllm(16, work / "upstream.log") as url:
        for _ in range(repeats):
            for name, make in (("httpx", _httpx), ("aiohttp", _aiohttp), ("raw", _raw)):
                results.setdefault(name, []).append(asyncio.run(_run(make, url, concurrency, rounds)))
        sys.modules.setdefault("sniffio", types.SimpleNamespace(current_async_library=lambda: "asyncio"))  # type: ignore[arg-type]
        for _ in range(repeats):
            results.setdefault("httpx+sniffio", []).append(asyncio.run(_run(_httpx, url, concurrency, rounds)))
    print(f"client CPU ms per streamed request ({concurrency} at once, 16 tokens, {rounds} bursts; each run)")
    for name, runs in results.items():
        print(f"| {name} | {sorted(runs)[len(runs) // 2]:.2f} | " + ", ".join(f"{r:.2f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
