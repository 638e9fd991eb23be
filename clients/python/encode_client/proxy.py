"""``encode-epd-proxy``: an OpenAI-compatible proxy that puts encode-server in front of a vLLM server.

Users change one URL (their OpenAI base URL, to the proxy's); the proxy rewrites each
``POST /v1/chat/completions`` with ``encode_client.epd.rewrite_chat_request`` (images go to
encode-server, the prefill server gets only ``uuid`` + metadata) and forwards it; every other
request (``/v1/models``, ``/v1/completions``, ``/health``, ``/metrics``...) and every answer,
streamed (SSE) or not, passes through unchanged::

    encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill:8000 --encoder http://encode-server:8000

Errors in OpenAI's shape: a part the proxy cannot read is a 400 naming it
(``messages[0].content[1]``); encode-server refusing an image passes its 4xx on; encode-server
or vLLM not answering is a 503 / 502. Standard library HTTP server (one thread per connection)
plus httpx: no dependency beyond the client's own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from encode_client._client import Client
from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client.epd import EPDError, rewrite_chat_request

__all__ = ["EPDProxy", "main"]

log = logging.getLogger("encode_client.proxy")

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
_CHAT = "/v1/chat/completions"


def _openai_error(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


class EPDProxy(ThreadingHTTPServer):
    """The proxy server; ``serve_forever()`` runs it, ``shutdown()`` stops it (tests run it in a thread)."""

    daemon_threads = True

    def __init__(
        self,
        listen: tuple[str, int],
        vllm_url: str,
        encoder_urls: Sequence[str],
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(listen, _Handler)
        self.vllm_url = vllm_url.rstrip("/")
        self.encoder = Client(list(encoder_urls), api_key=api_key, response="json", timeout=min(timeout, 60.0))
        self.upstream = httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host if isinstance(host, str) else host.decode()}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.encoder.close()
        self.upstream.close()


class _Handler(BaseHTTPRequestHandler):
    server: EPDProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        started = time.perf_counter()
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        images = 0
        if self.command == "POST" and self.path.split("?")[0] == _CHAT:
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise EPDError("the body must be a JSON object")
                rewritten, results = rewrite_chat_request(request, self.server.encoder)
            except (ValueError, EPDError) as exc:  # JSONDecodeError is a ValueError
                param = exc.where if isinstance(exc, EPDError) else None
                return self._send(400, _openai_error(400, str(exc), "invalid_request_error", param))
            except ServerError as exc:
                status = exc.status if 400 <= exc.status < 500 else 503
                return self._send(status, _openai_error(status, f"encode-server: {exc}", "encoder_error"))
            except ReplicaUnavailable as exc:
                return self._send(503, _openai_error(503, f"encode-server unavailable: {exc}", "encoder_unavailable"))
            images = len(results)
            body = json.dumps(rewritten).encode()
        self._forward(body)
        log.info(
            "%s %s images=%d %.1f ms", self.command, self.path, images, (time.perf_counter() - started) * 1000
        )

    def _forward(self, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        request = self.server.upstream.build_request(
            self.command, self.server.vllm_url + self.path, content=body, headers=headers
        )
        try:
            upstream = self.server.upstream.send(request, stream=True)
        except httpx.HTTPError as exc:
            return self._send(502, _openai_error(502, f"vLLM server unreachable: {exc!r}", "upstream_unavailable"))
        try:
            self.send_response(upstream.status_code)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in upstream.iter_raw():
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (httpx.HTTPError, OSError) as exc:
            log.warning("%s %s: stream from vLLM ended early: %r", self.command, self.path, exc)
            self.close_connection = True
        finally:
            upstream.close()


def _address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="encode-epd-proxy", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--listen", type=_address, default=("127.0.0.1", 8080), help="HOST:PORT (default 127.0.0.1:8080)"
    )
    parser.add_argument("--vllm", required=True, help="the vLLM (prefill) server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--encoder", action="append", required=True, help="encode-server replica URL (repeatable)"
    )
    parser.add_argument("--api-key", default=os.environ.get("ENCODE_CLIENT_API_KEY"), help="encode-server API key")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one upstream answer")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = EPDProxy(args.listen, args.vllm, args.encoder, api_key=args.api_key, timeout=args.timeout)
    log.info("EPD proxy on %s -> vLLM %s, encode-server %s", proxy.url, proxy.vllm_url, ", ".join(args.encoder))
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
