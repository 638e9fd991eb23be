"""``encode-epd-proxy``: an OpenAI-compatible proxy that puts encode-server in front of vLLM servers.

Users change one URL (their OpenAI base URL, to the proxy's); the proxy rewrites each
``POST /v1/chat/completions`` with ``encode_client.epd`` (images and videos go to encode-server; the
prefill server gets an identifier computed from the bytes, with the metadata or the image itself as
the served family's EPD mode says, read once from encode-server's
``GET /v1/model``) and forwards it, and every answer, streamed (SSE) or not, comes back as it arrives::

    encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill-a:8000 --vllm http://prefill-b:8000 \\
        --encoder http://encode-server:8000

Asynchronous (Starlette's ASGI primitives under uvicorn: the client package's ``[proxy]`` extra),
with keep-alive connection pools to vLLM and to encode-server. Several vLLM upstreams: each request
goes to the one with the fewest outstanding requests (``_upstreams``); one that refuses a
connection is skipped for a while and the request goes to the next. At most ``--max-concurrency``
requests at once (past it 503 ``overloaded_error``), bounded heads (``--max-header-bytes``, 431),
bodies and timeouts, OpenAI-shaped errors. ``GET /health`` and ``GET /metrics`` are the proxy's own
(``_proxy_metrics``). The first SIGTERM or SIGINT drains (``/health`` answers 503, new requests
503, requests in flight have ``--drain-seconds`` to finish); the second cuts what is left, each
stream ending with an error event and ``data: [DONE]`` (``_proxy_stop``).

A request vLLM failed before answering (its EC connector found the embedding neither in Redis nor
at encode-server: vLLM's generic 500, or the same error as a stream's first event,
``_vllm_failure``) is retried ``--retries`` times, after its images and videos are handed off again.

The proxy is the only client of the prefill servers (docs/vllm.md, "Threat model"), so it forwards
only what it checks: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the fields that
steer vLLM's caches refused, ``cache_salt`` derived from the caller's tenant) and the read-only
``GET`` routes in ``FORWARDED``; anything else is a 404. With ``--api-keys`` (``KEY`` or
``TENANT:KEY``, encode-server's list) every route but the probes needs a caller's key, encode-server
is called with that caller's own key (so its tenant isolation applies per caller), and the
caller's ``Authorization`` never reaches vLLM (``--vllm-api-key`` is sent there instead).

The pieces, one module each: ``_proxy_app`` (the ASGI app: admission, then the rewrite and the
forward), ``_proxy_rewrite`` (a body as vLLM gets it), ``_proxy_forward`` (failover across
upstreams; the first SSE event read apart from it), ``_proxy_errors`` (every answer the proxy gives
itself, and what each exception becomes), ``_proxy_head`` (the cap on request heads),
``_proxy_stop`` (the drain and the cut), ``proxy_cli`` (the command line and ``EPDProxy``).
"""


from __future__ import annotations

import sys

from encode_client._errors import install_hint

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"encode-epd-proxy needs its [proxy] extra ({exc}): {install_hint('proxy')}") from exc

from encode_client._proxy_app import FORWARDED, OPEN_PATHS, OWN_ROUTES, ProxyApp
from encode_client._proxy_settings import ProxySettings
from encode_client.proxy_cli import EPDProxy, build_parser, main

__all__ = ["FORWARDED", "OPEN_PATHS", "OWN_ROUTES", "EPDProxy", "ProxyApp", "ProxySettings", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
