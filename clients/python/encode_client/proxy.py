"""``encode-epd-proxy``: an OpenAI-compatible proxy that puts encode-server in front of a vLLM server.

Users change one URL (their OpenAI base URL, to the proxy's); the proxy rewrites each
``POST /v1/chat/completions`` with ``encode_client.epd.rewrite_chat_request`` (images go to
encode-server; the prefill server gets an identifier computed from the bytes, with the metadata or
the image itself as the served family's EPD mode says, read once from encode-server's
``GET /v1/model``) and forwards it, and every answer, streamed (SSE) or not, comes back unchanged::

    encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill:8000 --encoder http://encode-server:8000

The proxy is the only client of the prefill server (docs/vllm.md, "Threat model"), so it forwards
only what it checks: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the fields that
steer vLLM's caches refused, ``cache_salt`` derived from the caller's tenant) and the read-only
``GET`` routes in ``FORWARDED``; anything else is a 404. With ``--api-keys`` (``KEY`` or
``TENANT:KEY``, encode-server's list) every route but the probes needs a caller's key, encode-server
is called with that caller's own key (so its tenant isolation applies per caller), and the
caller's ``Authorization`` never reaches vLLM (``--vllm-api-key`` is sent there instead).

Errors in OpenAI's shape: a part the proxy cannot read or refuses is a 400 naming it
(``messages[0].content[1]``); a missing or unknown key is a 401; encode-server refusing an image
passes its 4xx on; encode-server or vLLM not answering is a 503 / 502; encode-server serving a
model no vLLM prefill consumes through EPD is a 502 ``encoder_error``. Standard library HTTP
server (one thread per connection) plus httpx: no dependency beyond the client's own.
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

from encode_client._callers import Caller, Callers
from encode_client._client import Client
from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client.epd import (
    EpdContract,
    EpdContractError,
    EPDError,
    cache_salt,
    check_request_fields,
    rewrite_chat_request,
)

__all__ = ["FORWARDED", "OPEN_PATHS", "EPDProxy", "build_parser", "main"]

log = logging.getLogger("encode_client.proxy")

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length"}
)
_CHAT = "/v1/chat/completions"
# Every route vLLM serves that a client may reach through the proxy. Others (the Responses, pooling,
# tokenizer, render, token-in and admin routes) take content the proxy does not check, such as a
# part with a uuid, so they are refused rather than forwarded.
FORWARDED = frozenset(
    {("POST", _CHAT), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/ping"),
     ("GET", "/version"), ("GET", "/metrics"), ("GET", "/load")}
)
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})  # probes: no key needed


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
        api_keys: str | None = None,
        vllm_api_key: str | None = None,
        trust_client_embeds: bool = False,
        timeout: float = 600.0,
    ) -> None:
        """``api_key``: encode-server's key for every caller, when callers are not authenticated;
        ``api_keys``: the callers' keys (``KEY`` or ``TENANT:KEY``, comma-separated), each used as
        its own caller's encode-server key; ``trust_client_embeds``: let callers send embeddings
        (every caller must then be trusted: it decides what the model sees for its own parts)."""
        if api_key and api_keys:
            raise ValueError("give api_key (one encode-server key) or api_keys (the callers' keys), not both")
        self.callers = Callers(api_keys) if api_keys else None
        self.vllm_url = vllm_url.rstrip("/")
        self.vllm_api_key = vllm_api_key
        self.trust_client_embeds = trust_client_embeds
        encoder_timeout = min(timeout, 60.0)
        keys = [c.key for c in self.callers] if self.callers is not None else [api_key]
        self.encoders = {
            k: Client(list(encoder_urls), api_key=k, response="json", timeout=encoder_timeout) for k in keys
        }
        self.upstream = httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0))
        self._contract: EpdContract | None = None
        super().__init__(listen, _Handler)

    def encoder_for(self, caller: Caller | None) -> Client:
        """The encode-server client that speaks for ``caller`` (with its key, hence its tenant)."""
        return self.encoders[caller.key if caller is not None else next(iter(self.encoders))]

    def contract(self, caller: Caller | None) -> EpdContract:
        """The served family's EPD contract, read from encode-server once (two threads racing read it
        twice, harmlessly); a failed read is retried by the next request."""
        if self._contract is None:
            self._contract = EpdContract.from_model(self.encoder_for(caller).model())
        return self._contract

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host if isinstance(host, str) else host.decode()}:{port}"

    def server_close(self) -> None:
        super().server_close()
        for encoder in self.encoders.values():
            encoder.close()
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

    def do_PUT(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        started = time.perf_counter()
        path = self.path.split("?")[0]
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True
            return self._send(400, _openai_error(400, "invalid Content-Length", "invalid_request_error"))
        body = self.rfile.read(length) if length else b""
        if (self.command, path) not in FORWARDED:
            routes = ", ".join(f"{m} {p}" for m, p in sorted(FORWARDED))
            message = f"the EPD proxy does not forward {self.command} {path}; it forwards {routes}"
            return self._send(404, _openai_error(404, message, "not_found_error"))
        caller = None
        if self.server.callers is not None and path not in OPEN_PATHS:
            caller = self.server.callers.authenticate(self.headers.get("Authorization"))
            if caller is None:
                message = "missing or unknown API key: send 'Authorization: Bearer KEY'"
                return self._send(401, _openai_error(401, message, "authentication_error"))
        images = 0
        if self.command == "POST":
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise EPDError("the body must be a JSON object")
                if path == _CHAT:
                    rewritten, results = rewrite_chat_request(
                        request, self.server.encoder_for(caller), trust_client_embeds=self.server.trust_client_embeds,
                        contract=lambda: self.server.contract(caller),
                    )
                    images = len(results)
                else:
                    check_request_fields(request)
                    rewritten = dict(request)
                rewritten["cache_salt"] = cache_salt(caller.tenant if caller else None, request.get("cache_salt"))
            except EpdContractError as exc:
                return self._send(502, _openai_error(502, f"encode-server: {exc}", "encoder_error"))
            except (ValueError, EPDError) as exc:  # JSONDecodeError is a ValueError
                param = exc.where if isinstance(exc, EPDError) else None
                return self._send(400, _openai_error(400, str(exc), "invalid_request_error", param))
            except ServerError as exc:
                status = exc.status if 400 <= exc.status < 500 else 503
                return self._send(status, _openai_error(status, f"encode-server: {exc}", "encoder_error"))
            except ReplicaUnavailable as exc:
                return self._send(503, _openai_error(503, f"encode-server unavailable: {exc}", "encoder_unavailable"))
            body = json.dumps(rewritten).encode()
        self._forward(body)
        log.info(
            "%s %s images=%d tenant=%s %.1f ms",
            self.command,
            path,
            images,
            caller.tenant if caller is not None and caller.tenant is not None else "-",
            (time.perf_counter() - started) * 1000,
        )

    def _forward(self, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.server.callers is not None or self.server.vllm_api_key:  # a caller's key stays here
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        if self.server.vllm_api_key:
            headers["Authorization"] = f"Bearer {self.server.vllm_api_key}"
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


def build_parser() -> argparse.ArgumentParser:
    """The command line (docs/vllm.md's proxy flag table lists exactly these flags; a test checks)."""
    parser = argparse.ArgumentParser(prog="encode-epd-proxy", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--listen", type=_address, default=("127.0.0.1", 8080), help="HOST:PORT (default 127.0.0.1:8080)"
    )
    parser.add_argument("--vllm", required=True, help="the vLLM (prefill) server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--encoder", action="append", required=True, help="encode-server replica URL (repeatable)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("ENCODE_CLIENT_API_KEY"),
        help="encode-server API key for every caller (callers are not authenticated); env ENCODE_CLIENT_API_KEY",
    )
    parser.add_argument(
        "--api-keys", default=os.environ.get("ENCODE_EPD_PROXY_API_KEYS"),
        help="the callers' keys, comma-separated KEY or TENANT:KEY (encode-server's list): each caller is "
        "authenticated and calls encode-server with its own key; env ENCODE_EPD_PROXY_API_KEYS",
    )
    parser.add_argument(
        "--vllm-api-key", default=os.environ.get("ENCODE_EPD_PROXY_VLLM_API_KEY"),
        help="sent to vLLM (its --api-key) instead of the caller's Authorization; env ENCODE_EPD_PROXY_VLLM_API_KEY",
    )
    parser.add_argument(
        "--trust-client-embeds", action="store_true",
        help="accept image/video/audio embeddings parts from callers, each named by the content hash of its "
        "payload (never the client's uuid); only for a proxy whose every caller is trusted",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one upstream answer")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = EPDProxy(
            args.listen, args.vllm, args.encoder, api_key=args.api_key, api_keys=args.api_keys,
            vllm_api_key=args.vllm_api_key, trust_client_embeds=args.trust_client_embeds, timeout=args.timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))
    log.info(
        "EPD proxy on %s -> vLLM %s, encode-server %s; %s; client embeddings %s",
        proxy.url, proxy.vllm_url, ", ".join(args.encoder),
        f"{len(proxy.callers)} caller key(s)" if proxy.callers else "callers not authenticated",
        "accepted (re-keyed by content)" if args.trust_client_embeds else "refused",
    )
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
