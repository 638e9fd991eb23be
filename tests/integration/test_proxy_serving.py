"""``encode-epd-proxy`` fit for traffic, over real HTTP: several upstreams (least outstanding
requests, one that refuses connections skipped), answers streamed as they arrive, bounded
concurrency, bodies and timeouts with OpenAI-shaped errors, a request vLLM failed before answering
retried after its images are handed off again (a real encode-server), ``/health`` and ``/metrics``
(the stop on a signal and the cap on heads: test_proxy_stop.py).

vLLM's part is played by ``tests.proxy_upstream.StubVllm`` (what a real vLLM cannot be made to do
on demand: hold a request, fail one); tests/vllm/test_proxy.py runs the proxy against vLLM itself.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from encode_client.proxy import EPDProxy

from tests.images import image_bytes
from tests.proxy_upstream import StubVllm
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server
from tests.tools import wait_until

pytestmark = pytest.mark.integration

NOWHERE = f"http://127.0.0.1:{free_port()}"
PREFIX = f"test-proxy-serving-{os.getpid()}"


class _Running:
    def __init__(self, proxy: EPDProxy) -> None:
        self.proxy = proxy
        self.thread = threading.Thread(target=proxy.serve_forever, daemon=True)

    def __enter__(self) -> EPDProxy:
        self.thread.start()
        wait_until(lambda: self.proxy._server.started, "the proxy started")
        return self.proxy

    def __exit__(self, *exc: object) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()


def running(upstreams: list[str], encoders: list[str] | None = None, **options: Any) -> _Running:
    return _Running(EPDProxy(("127.0.0.1", 0), upstreams, encoders or [NOWHERE], **options))


def text_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def post(url: str, body: dict[str, Any], timeout: float = 30, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout, headers=headers)


def metric(proxy: EPDProxy, name: str, **labels: str) -> float:
    text = httpx.get(proxy.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def test_requests_go_to_the_upstream_with_the_fewest_outstanding() -> None:
    """Four requests held open on two upstreams: two each. Then one upstream has one more held
    request than the other, and the next request goes to the other."""
    with StubVllm("a") as a, StubVllm("b") as b, running([a.url, b.url]) as proxy, ThreadPoolExecutor(8) as pool:
        held = [pool.submit(post, proxy.url, text_chat(hold=True)) for _ in range(4)]
        wait_until(lambda: a.active + b.active == 4, "four requests held")
        assert (a.active, b.active) == (2, 2)
        assert metric(proxy, "encode_epd_proxy_upstream_outstanding", upstream=a.url) == 2
        a.release()  # the stubs share nothing: a answers its two, b still holds its two
        wait_until(lambda: a.active == 0 and a.served == 2, "a's requests answered")
        one = pool.submit(post, proxy.url, text_chat())
        assert one.result().status_code == 200
        assert (len(a.bodies), len(b.bodies)) == (3, 2), "the next request went to a, which had none outstanding"
        b.release()
        for f in [*held, one]:
            assert f.result().status_code == 200


def test_an_upstream_that_refuses_connections_is_skipped() -> None:
    with StubVllm() as stub, running([NOWHERE, stub.url]) as proxy:
        for _ in range(4):
            assert post(proxy.url, text_chat()).status_code == 200
        assert stub.served == 4
        assert metric(proxy, "encode_epd_proxy_upstream_up", upstream=NOWHERE) == 0
        assert metric(proxy, "encode_epd_proxy_upstream_up", upstream=stub.url) == 1
    with running([NOWHERE]) as proxy:
        r = post(proxy.url, text_chat())
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"


class _DropsKeptAlive:
    """A raw HTTP/1.1 upstream that answers the first request on each connection (keeping it alive)
    and closes the connection on the next without a byte: the moment a server's keep-alive timeout
    closes an idle connection just as the proxy reuses it. ``always``: every request is dropped."""

    _ANSWER = b'{"id": "x", "object": "chat.completion", "choices": []}'

    def __init__(self, always: bool = False) -> None:
        self.always, self.answered, self.dropped = always, 0, 0
        self.heads: list[list[bytes]] = []  # each request's header lines, as they came
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            for n in itertools.count():
                head = [line for line in iter(reader.readline, b"\r\n") if line]
                if not head:
                    return
                self.heads.append(head)
                length = next((int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length")), 0)
                reader.read(length)
                if n >= 1 or self.always:
                    self.dropped += 1
                    return
                self.answered += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(self._ANSWER)).encode() + b"\r\n\r\n" + self._ANSWER)

    def close(self) -> None:
        self._sock.close()


def test_a_kept_alive_connection_closed_under_a_request_is_sent_again_once() -> None:
    """The proxy keeps one pool of connections to vLLM, so the second request reuses the first
    one's connection, which the upstream closes without answering: sent again on a fresh
    connection, answered 200, counted; a third finds the closed connection gone from the pool. An
    upstream that closes every connection gets one resend, then a 502."""
    upstream = _DropsKeptAlive()
    try:
        with running([upstream.url]) as proxy:
            codes = [post(proxy.url, text_chat()).status_code for _ in range(3)]
            assert codes == [200] * 3
            assert (upstream.answered, upstream.dropped) == (3, 1)
            assert metric(proxy, "encode_epd_proxy_retries_total", reason="disconnected") == 1
    finally:
        upstream.close()
    upstream = _DropsKeptAlive(always=True)
    try:
        with running([upstream.url]) as proxy:
            r = post(proxy.url, text_chat())
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"
            assert upstream.dropped == 2
    finally:
        upstream.close()


def test_vllm_is_asked_for_the_encoding_the_caller_asked_for_and_no_other() -> None:
    """The proxy relays vLLM's bytes undecoded, so it must not ask vLLM for a compression its
    caller did not ask for: no Accept-Encoding of its own; the caller's goes through."""
    upstream = _DropsKeptAlive(always=False)
    try:
        with running([upstream.url]) as proxy:
            host, port = proxy.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            body = json.dumps(text_chat()).encode()
            conn.putrequest("POST", "/v1/chat/completions", skip_accept_encoding=True)
            conn.putheader("content-type", "application/json")
            conn.putheader("content-length", str(len(body)))
            conn.endheaders(body)
            assert conn.getresponse().status == 200
            conn.close()
            assert post(proxy.url, text_chat(), headers={"Accept-Encoding": "gzip"}).status_code == 200
        first, second = ([h.lower() for h in head] for head in upstream.heads[:2])
        assert not [h for h in first if h.startswith(b"accept-encoding")], first
        assert b"accept-encoding: gzip\r\n" in second, second
    finally:
        upstream.close()


def test_a_stream_passes_through_as_it_arrives() -> None:
    """The first token reaches the client while vLLM still holds the rest of the stream."""
    with StubVllm(tokens=3) as stub, running([stub.url]) as proxy:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=text_chat(stream=True, hold_stream=True),
                          timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            received = []
            for line in lines:
                if line.startswith("data: ") and '"t0 "' in line:
                    received.append(line)
                    break
            # The stub counts a stream held when its generator is resumed after the first token, which
            # may come a moment after the client has that token: wait for it, then nothing is served.
            deadline = time.monotonic() + 10
            while stub.streams_held == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert received and stub.streams_held == 1 and stub.served == 0, "the rest is not sent yet"
            stub.release()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and stub.served == 1


def test_concurrency_bodies_and_timeouts_are_bounded() -> None:
    with StubVllm() as stub, running([stub.url], max_concurrency=2, max_body_bytes=4096, timeout=3) as proxy:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, proxy.url, text_chat(hold=True)) for _ in range(2)]
            wait_until(lambda: stub.active == 2, "two requests held")
            over = post(proxy.url, text_chat())
            assert over.status_code == 503 and over.json()["error"]["type"] == "overloaded_error"
            assert over.headers["retry-after"] == "1"
            for f in held:  # the held requests outlive --timeout: vLLM said nothing for 3 s
                r = f.result()
                assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout", r.text
        stub.release()
        big = post(proxy.url, text_chat(padding="x" * 5000))
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
        assert post(proxy.url, text_chat()).status_code == 200
        assert metric(proxy, "encode_epd_proxy_errors_total", type="overloaded_error") == 1
        assert metric(proxy, "encode_epd_proxy_errors_total", type="upstream_timeout") == 2


@pytest.fixture(scope="module")
def encoder(shared_redis_url: str, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--redis-url", shared_redis_url, "--cache-prefix", PREFIX, log_dir=server_logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), PREFIX)


def image_chat(seed: int, **extra: Any) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image_bytes("PNG", 40, 30, seed=seed)).decode()
    return {"model": "stub", "max_tokens": 4, **extra,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is it"}]}]}


def _items(server: ServerProcess, status: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("encode_server_items_total{") and f'status="{status}"' in line)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_vllm_failed_is_handed_off_again_and_retried_once(encoder: ServerProcess, stream: bool) -> None:
    """vLLM fails the first try as its EC connector does (no embedding): the proxy hands the image
    off again, sends again, and the client gets the second answer, none of the first. A second
    failure is passed on as vLLM gave it; a request without images is never retried."""
    with StubVllm() as stub, running([stub.url], [encoder.url]) as proxy:
        stub.fail_next = 1
        encoded, hits = _items(encoder, "encoded"), _items(encoder, "hit")
        r = post(proxy.url, image_chat(seed=1 + stream, stream=stream))
        assert r.status_code == 200, r.text
        assert "InternalServerError" not in r.text and "t0" in r.text
        assert len(stub.bodies) == 2 and stub.bodies[0] == stub.bodies[1], "the same rewritten request, twice"
        assert _items(encoder, "encoded") == encoded + 1
        assert _items(encoder, "hit") == hits + 1, "the image was handed off again before the retry"
        assert metric(proxy, "encode_epd_proxy_retries_total", reason="prefill_error") == 1

        stub.fail_next = 2
        r = post(proxy.url, image_chat(seed=1 + stream, stream=stream))
        assert "InternalServerError" in r.text
        assert r.status_code == (200 if stream else 500)
        assert metric(proxy, "encode_epd_proxy_retries_total", reason="prefill_error") == 2

        stub.fail_next, sent = 1, len(stub.bodies)
        r = post(proxy.url, text_chat(stream=stream))
        assert "InternalServerError" in r.text and len(stub.bodies) == sent + 1, "no images: not retried"
        stub.fail_next = 0


def test_health_and_metrics_are_the_proxys_own() -> None:
    with StubVllm() as stub, running([stub.url, NOWHERE]) as proxy:
        health = httpx.get(proxy.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["upstreams"] == {stub.url: "up", NOWHERE: "down"}
        assert post(proxy.url, text_chat()).status_code == 200
        text = httpx.get(proxy.url + "/metrics", timeout=10).text
        for name in ("encode_epd_proxy_requests_total", "encode_epd_proxy_request_seconds_bucket",
                     "encode_epd_proxy_upstream_seconds_bucket", "encode_epd_proxy_inflight"):
            assert name in text, name
        assert metric(proxy, "encode_epd_proxy_requests_total", route="/v1/chat/completions", code="200") == 1
    with running([NOWHERE]) as proxy:
        r = httpx.get(proxy.url + "/health", timeout=10)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"
