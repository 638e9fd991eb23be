"""The thinnest HTTP/1.1 the benchmarks can use, so that the client's own cost stays out of the figures.

- ``Conn``: one blocking keep-alive connection (``http.client``), for one-request-at-a-time timing.
- ``post_many``: N requests over C asyncio keep-alive connections, a hand-written HTTP/1.1 exchange
  (write the request, read headers, read ``Content-Length`` bytes): far cheaper than httpx, which
  would otherwise share the two cores with the server under test.
- ``python -m bench.rawhttp serve DIR PORT``: the "raw wire" reference server, an asyncio server that
  answers ``POST /<name>`` with the bytes of ``DIR/<name>`` (read once, held in memory), no framework.
  S2 compares encode-server's cache hits with it, byte for byte the same answers.
"""

from __future__ import annotations

import asyncio
import http.client
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Conn", "Request", "exchange", "post_many", "serve"]


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes
    content_type: str = "application/json"
    accept: str = "application/vnd.safetensors"


class Conn:
    """One keep-alive connection to ``127.0.0.1:port``; ``post`` returns (status, body, seconds)."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def post(self, req: Request) -> tuple[int, bytes, float]:
        """One POST; a keep-alive connection the server closed while idle is reopened (and that
        attempt is the one timed)."""
        headers = {"Content-Type": req.content_type, "Accept": req.accept, "Content-Length": str(len(req.body))}
        for attempt in (1, 2):
            started = time.perf_counter()
            try:
                self._conn.request("POST", req.path, body=req.body, headers=headers)
                response = self._conn.getresponse()
                body = response.read()
                return response.status, body, time.perf_counter() - started
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                self._conn.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            return self._get(path)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self._conn.close()
            return self._get(path)

    def _get(self, path: str) -> tuple[int, bytes]:
        self._conn.request("GET", path)
        response = self._conn.getresponse()
        return response.status, response.read()

    def close(self) -> None:
        self._conn.close()


def _head(req: Request) -> bytes:
    return (
        f"POST {req.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {req.content_type}\r\n"
        f"Accept: {req.accept}\r\nContent-Length: {len(req.body)}\r\n\r\n"
    ).encode("latin-1")


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: Request) -> tuple[int, bytes]:
    """One request on a keep-alive connection: (status, body). The answer must carry a
    ``Content-Length`` (uvicorn's and vLLM's non-streamed answers do)."""
    writer.write(_head(req))
    writer.write(req.body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def _post_many(port: int, requests: Sequence[Request], concurrency: int, timeout: float) -> list[float]:
    queue = list(enumerate(requests))
    latencies = [0.0] * len(requests)
    errors: list[str] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                i, req = queue.pop()
                started = time.perf_counter()
                status, _ = await asyncio.wait_for(exchange(reader, writer, req), timeout)
                latencies[i] = time.perf_counter() - started
                if status != 200:
                    errors.append(f"{req.path}: HTTP {status}")
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return latencies


def post_many(
    port: int, requests: Sequence[Request], concurrency: int, timeout: float = 120.0
) -> tuple[float, list[float]]:
    """Send every request over ``concurrency`` connections; (wall seconds, per-request seconds)."""
    started = time.perf_counter()
    latencies = asyncio.run(_post_many(port, requests, concurrency, timeout))
    return time.perf_counter() - started, latencies


async def serve(directory: Path, port: int) -> None:
    answers = {"/" + p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    heads = {
        path: (
            f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        for path, body in answers.items()
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if path in answers:
                    writer.write(heads[path])
                    writer.write(answers[path])
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "serve":
        raise SystemExit("usage: python -m bench.rawhttp serve DIR PORT")
    asyncio.run(serve(Path(sys.argv[2]), int(sys.argv[3])))
