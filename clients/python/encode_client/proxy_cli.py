"""``encode-epd-proxy``: an OpenAI-compatible proxy that puts encode-server in front of vLLM servers.

Its command line (``build_parser``, ``main``) and ``EPDProxy``, the proxy on a socket of its own
under uvicorn, which the command line and the tests run; the application is ``_proxy_app``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

import uvicorn

from encode_client._proxy_app import ProxyApp
from encode_client._proxy_head import head_capped_protocol
from encode_client._proxy_settings import ProxySettings
from encode_client._proxy_stop import CUT_GRACE_S, ProxyServer

__all__ = ["EPDProxy", "build_parser", "main"]

log = logging.getLogger("encode_client.proxy")


# What uvicorn may take, once the drain is over, to close idle connections.
_CLOSE_S = 5


class EPDProxy:
    """The proxy on a socket of its own, bound at construction (so ``url`` is known at once):
    ``serve_forever()`` runs it (in a thread of a program or a test, or the CLI's main thread,
    where the first SIGTERM or SIGINT drains it and the second cuts what is left: ``ProxyServer``),
    ``shutdown()`` from another thread drains and stops it."""

    def __init__(
        self, listen: tuple[str, int], vllm_url: str | Sequence[str], encoder_urls: Sequence[str], **options: Any
    ) -> None:
        """``options``: the fields of ``ProxySettings`` (``api_key``: encode-server's key for every
        caller; ``api_keys``: the callers' keys, each used as its own caller's encode-server key;
        ``trust_client_embeds``: let callers send embeddings; timeouts and limits)."""
        vllm_urls = (vllm_url,) if isinstance(vllm_url, str) else tuple(vllm_url)
        self.settings = ProxySettings(vllm_urls=vllm_urls, encoder_urls=tuple(encoder_urls), **options)
        self.app = ProxyApp(self.settings)
        self._sock = socket.create_server(listen, backlog=2048)
        limit = self.settings.max_header_bytes
        protocol = head_capped_protocol(limit, self.app.head_refused)
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", server_header=False, interface="asgi3",
            timeout_graceful_shutdown=_CLOSE_S,  # the drain (ProxyServer) has already waited for requests
            timeout_keep_alive=math.ceil(self.settings.keep_alive_timeout),
            **({"http": protocol} if protocol is not None else {"h11_max_incomplete_event_size": limit}),
        )
        self._server = ProxyServer(config, self.app, self.settings.drain_seconds)
        self._done = threading.Event()

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def vllm_url(self) -> str:
        return self.settings.vllm_urls[0]

    def serve_forever(self) -> None:
        """Serve until ``shutdown()`` or a signal; on uvicorn's event loop (uvloop when installed)."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._done.set()

    def shutdown(self) -> None:
        """Drain, as the first SIGTERM does, and wait for the stop."""
        self._server.request_stop("shutdown()")
        self._done.wait(self.settings.drain_seconds + CUT_GRACE_S + _CLOSE_S + 5)

    def server_close(self) -> None:
        self._sock.close()


def _address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The command line (docs/epd-proxy.md's flag table lists exactly these flags; a test checks)."""
    parser = argparse.ArgumentParser(prog="encode-epd-proxy", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--listen", type=_address, default=("127.0.0.1", 8080), help="HOST:PORT (default 127.0.0.1:8080)"
    )
    parser.add_argument(
        "--vllm", action="append", required=True,
        help="a vLLM (prefill) server's base URL, e.g. http://127.0.0.1:8000 (repeatable: least outstanding requests)",
    )
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
    parser.add_argument(
        "--trust-request-mm-kwargs", action="store_true",
        help="take a chat's mm_processor_kwargs (e.g. Qwen's max_pixels) and media_io_kwargs.video (a Qwen video's "
        "fps), as vLLM's flag of this name does: checked against the served family's keys, every image or video "
        "handed off under them (named by its bytes and the settings), dropped for vLLM where the grid carries them, "
        "kept for a pixels + uuid family's processor, with the identifiers vLLM then hashes named to its connector); "
        "also the Omni thinkers' use_audio_in_video; encode-server needs its own flag of this name for settings",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds vLLM may take for its next byte")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to vLLM")
    parser.add_argument(
        "--encoder-timeout", type=float, default=60.0, help="seconds for one call to encode-server (the hand-off)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=512, help="requests served at once; past it 503 overloaded_error"
    )
    parser.add_argument(
        "--max-connections", type=int, default=1024, help="keep-alive connections to vLLM and to encode-server"
    )
    parser.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024, help="largest request body")
    parser.add_argument(
        "--max-header-bytes", type=int, default=64 * 1024,
        help="largest request head: its request line and headers, in bytes; past it 431, the connection closed",
    )
    parser.add_argument(
        "--retries", type=int, default=1,
        help="times a request vLLM failed before answering is sent again, after its images and videos are handed off "
        "again",
    )
    parser.add_argument(
        "--drain-seconds", type=float, default=30.0,
        help="on the first SIGTERM or SIGINT, how long requests in flight may take to finish; a second cuts them",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # one line per request: the proxy's, not httpx's for each call it makes
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    options = {
        "api_key": args.api_key, "api_keys": args.api_keys, "vllm_api_key": args.vllm_api_key,
        "trust_client_embeds": args.trust_client_embeds, "timeout": args.timeout,
        "trust_request_mm_kwargs": args.trust_request_mm_kwargs,
        "connect_timeout": args.connect_timeout, "encoder_timeout": args.encoder_timeout,
        "max_concurrency": args.max_concurrency, "max_connections": args.max_connections,
        "max_body_bytes": args.max_body_bytes, "max_header_bytes": args.max_header_bytes, "retries": args.retries,
        "drain_seconds": args.drain_seconds,
    }
    try:
        proxy = EPDProxy(args.listen, args.vllm, args.encoder, **options)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    log.info(
        "EPD proxy on %s -> vLLM %s, encode-server %s; %s; client embeddings %s",
        proxy.url, ", ".join(proxy.settings.vllm_urls), ", ".join(args.encoder),
        f"{len(proxy.app.callers)} caller key(s)" if proxy.app.callers else "callers not authenticated",
        "accepted (re-keyed by content)" if args.trust_client_embeds else "refused",
    )
    # While it serves, ProxyServer takes both signals; before and after, one must not end the
    # process with a KeyboardInterrupt's traceback: a stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        proxy.serve_forever()
    finally:
        proxy.server_close()
    log.info("EPD proxy stopped")
    return 0
