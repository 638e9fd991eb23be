"""How ``encode-epd-proxy`` stops, and the cap on request heads, over real HTTP: the real command
under SIGTERM and SIGINT (the first drains with ``/health`` at 503 and says so in its log; the
second cuts every stream with an error event and ``data: [DONE]``, logs them as cut and prints no
traceback), the drain's time running out, and ``--max-header-bytes``.

vLLM's part is played by ``tests.proxy_upstream.StubVllm``, which holds requests and streams open
on demand: nothing here needs vLLM or encode-server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from encode_client.proxy import EPDProxy

from tests.proxy_upstream import StubVllm
from tests.server import free_port
from tests.tools import wait_until

pytestmark = pytest.mark.integration

NOWHERE = f"http://127.0.0.1:{free_port()}"
CHAT = "/v1/chat/completions"


def text_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


@dataclass
class Stream:
    """A streamed chat read on a thread of its own: its ``data:`` lines, or what broke it."""

    url: str
    lines: list[str] = field(default_factory=list)
    status: int = 0
    broke: Exception | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url + CHAT, json=text_chat(stream=True, hold_stream=True), timeout=30) as r:
                self.status = r.status_code
                self.lines.extend(line for line in r.iter_lines() if line.startswith("data: "))
        except httpx.HTTPError as exc:
            self.broke = exc

    def join(self) -> Stream:
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self


@dataclass
class Command:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def command(stub: StubVllm, tmp_path: Path, *flags: str) -> Iterator[Command]:
    """The real ``encode-epd-proxy`` in front of ``stub``, its log at ``info``, answering ``/health``."""
    port = free_port()
    cmd = [sys.executable, "-m", "encode_client.proxy", "--listen", f"127.0.0.1:{port}", "--vllm", stub.url,
           "--encoder", NOWHERE, "--log-level", "info", *flags]
    log_path = tmp_path / "proxy.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    running = Command(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        def up() -> bool:
            try:
                return httpx.get(running.url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the proxy answered /health")
        yield running
    finally:
        stub.release()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_first_signal_drains_with_health_503_and_says_so(tmp_path: Path, sig: signal.Signals) -> None:
    """While a stream is in flight: ``/health`` answers 503 (the socket stays open), a new chat
    503 ``unavailable_error``, the log says what it waits for and for how long; the stream then
    finishes whole, and the process exits 0."""
    with StubVllm(tokens=3) as stub, command(stub, tmp_path, "--drain-seconds", "20",
                                             "--max-header-bytes", "16384") as proxy:
        big = httpx.get(proxy.url + "/v1/models", headers={"X-Big": "a" * 20_000}, timeout=10)
        assert big.status_code == 431 and "16384 bytes" in big.json()["error"]["message"], "the flag reaches the app"
        stream = Stream(proxy.url)
        wait_until(lambda: stub.streams_held == 1, "the stream is in flight")
        proxy.proc.send_signal(sig)
        wait_until(lambda: "draining" in proxy.log, "the drain is logged")
        health = httpx.get(proxy.url + "/health", timeout=5)
        assert health.status_code == 503, health.text
        assert health.json()["error"]["type"] == "unavailable_error" and health.headers["retry-after"] == "1"
        late = httpx.post(proxy.url + CHAT, json=text_chat(), timeout=5)
        assert late.status_code == 503 and late.json()["error"]["type"] == "unavailable_error"
        assert proxy.proc.poll() is None, "it waits for the stream in flight"
        assert (f"{sig.name}: draining: waiting up to 20 s (--drain-seconds) for 1 request(s) in flight "
                "(1 streaming) to finish") in proxy.log
        stub.release()
        assert stream.join().lines[-1] == "data: [DONE]" and stub.served == 1
        assert all("error" not in line for line in stream.lines)
        assert proxy.proc.wait(30) == 0
        assert "drained in" in proxy.log and "Traceback" not in proxy.log
        assert "HTTP Request:" not in proxy.log, "one line per request at info: the proxy's, not httpx's"
        assert f"POST {CHAT} 200 " in proxy.log


@pytest.mark.parametrize("sigs", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM),
                                  (signal.SIGTERM, signal.SIGINT)], ids=["INT-INT", "TERM-TERM", "TERM-INT"])
def test_a_second_signal_cuts_every_stream_with_an_error_event_and_done(
    tmp_path: Path, sigs: tuple[signal.Signals, signal.Signals]
) -> None:
    """Two streams mid-way and a chat vLLM has not answered: the streams end with an OpenAI error
    event then ``data: [DONE]``, the chat gets 503; each is logged as cut, not 200; no traceback,
    and the process exits 0 at once, not after ``--drain-seconds``."""
    with StubVllm(tokens=3) as stub, command(stub, tmp_path, "--drain-seconds", "60") as proxy:
        streams = [Stream(proxy.url), Stream(proxy.url)]
        wait_until(lambda: stub.streams_held == 2, "two streams in flight")
        waiting: list[httpx.Response] = []
        held = threading.Thread(target=lambda: waiting.append(
            httpx.post(proxy.url + CHAT, json=text_chat(hold=True), timeout=30)), daemon=True)
        held.start()
        wait_until(lambda: stub.active == 1, "a chat held before its answer (a stream is not counted active)")
        proxy.proc.send_signal(sigs[0])
        wait_until(lambda: "draining" in proxy.log, "the drain is logged")
        started = time.monotonic()
        proxy.proc.send_signal(sigs[1])
        for stream in streams:
            stream.join()
            assert stream.status == 200 and stream.broke is None, stream.broke
            assert stream.lines[-1] == "data: [DONE]", stream.lines
            error = json.loads(stream.lines[-2].removeprefix("data: "))["error"]
            assert (error["type"], error["code"]) == ("unavailable_error", 503)
            assert "t0" in stream.lines[1], "the tokens sent before the cut reached the client"
        held.join(30)
        assert waiting[0].status_code == 503 and waiting[0].json()["error"]["type"] == "unavailable_error"
        assert proxy.proc.wait(30) == 0
        assert time.monotonic() - started < 15, "cut at once, not after the drain"
        log = proxy.log
        assert "Traceback" not in log and "ERROR" not in log, log
        assert f"{sigs[1].name} again: cutting 3 request(s) in flight: 2 stream(s)" in log, log
        assert log.count(f"POST {CHAT} cut (stream ended with an error event and [DONE] after 200)") == 2, log
        assert log.count(f"POST {CHAT} cut (answered 503)") == 1, log
        assert f"POST {CHAT} 200 " not in log, log


def test_the_drain_time_up_cuts_what_is_left() -> None:
    """``shutdown()`` (SIGTERM's drain, from another thread) with a stream that outlives
    ``drain_seconds``: the stream is cut as a second signal cuts it."""
    with StubVllm(tokens=3) as stub:
        proxy = EPDProxy(("127.0.0.1", 0), [stub.url], [NOWHERE], drain_seconds=0.5)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        wait_until(lambda: proxy._server.started, "the proxy started")
        try:
            stream = Stream(proxy.url)
            wait_until(lambda: stub.streams_held == 1, "the stream is in flight")
            started = time.monotonic()
            proxy.shutdown()
            assert 0.4 < time.monotonic() - started < 10
            assert stream.join().lines[-1] == "data: [DONE]"
            assert json.loads(stream.lines[-2].removeprefix("data: "))["error"]["type"] == "unavailable_error"
        finally:
            proxy.server_close()


def _raw_get(url: str, header_bytes: int) -> bytes:
    """A GET with one header of ``header_bytes`` sent over a socket of its own: all it reads
    until the proxy closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\nX-Big: " + b"a" * header_bytes + b"\r\n\r\n"
        with suppress(BrokenPipeError, ConnectionResetError):  # refused before it was all sent: read what came
            sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


@pytest.mark.parametrize(("limit", "size"), [(None, 1 << 20), (None, 100_000), (8192, 10_000)],
                         ids=["1MiB", "100kB-whole", "flag-8KiB"])
def test_a_head_over_the_cap_is_a_431_naming_the_flag_and_closed(limit: int | None, size: int) -> None:
    options = {"max_header_bytes": limit} if limit else {}
    cap = limit or 64 * 1024
    with StubVllm() as stub:
        proxy = EPDProxy(("127.0.0.1", 0), [stub.url], [NOWHERE], **options)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        wait_until(lambda: proxy._server.started, "the proxy started")
        try:
            answer = _raw_get(proxy.url, size)  # read until the proxy closes the connection: it does
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431 "), answer[:300]
            assert b"connection: close" in head.lower()
            error = json.loads(body)["error"]
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, 431)
            assert "--max-header-bytes" in error["message"] and str(cap) in error["message"]
            fits = httpx.get(proxy.url + "/v1/models", headers={"X-Big": "a" * (cap - 200)}, timeout=10)
            assert fits.status_code == 200, "a head under the cap is served"
            assert 'code="431"' in httpx.get(proxy.url + "/metrics", timeout=10).text
        finally:
            proxy.shutdown()
            proxy.server_close()
