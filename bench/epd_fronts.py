"""The two fronts the end-to-end benchmark puts before vLLM servers that have no front of their own.

- ``lor``: a least-outstanding-requests relay over R vLLM replicas, for the aggregated stack at
  R = 2 (what an operator puts before a pool of replicas; nginx's ``least_conn`` does the same).
  It relays the request's bytes unchanged and streams the answer back.
- ``vllm-epd``: vLLM's own EPD proxy, as its example wires it
  (``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py`` in vLLM's repository,
  with ``disagg_1e1pd_example.sh``): a chat that holds an image is first sent whole to the encoder
  instance (an EC producer) with ``max_tokens`` 1 and no streaming, and when that has answered the
  original request goes to a prefill/decode instance (an EC consumer), which finds the encoder's
  output in the shared storage. One change: the example picks the consumer at random; here it is
  the least-outstanding one, as for the other stacks, so the comparison is of EPD, not of routing.

Both pick an upstream with the client's own ``Upstreams`` (the state machine encode-epd-proxy uses),
and run under uvicorn in a process of their own: ``python -m bench.epd_fronts lor --port P
--upstream URL [--upstream URL]`` or ``... vllm-epd --encoder URL --upstream URL ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from encode_client._upstreams import Upstreams
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["build_app", "main"]

_MM_TYPES = {"image_url", "audio_url", "input_audio"}
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


def has_mm_input(body: dict[str, Any]) -> bool:
    """Whether a chat holds a multimodal part (the example's ``has_mm_input``)."""
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in _MM_TYPES for p in content):
            return True
    return False


def encoder_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the example sends its encoder: the chat as it is, one token, not streamed."""
    primer = copy.deepcopy(body)
    primer["max_tokens"] = 1
    primer["stream"] = False
    primer.pop("stream_options", None)
    if "max_completion_tokens" in primer:
        primer["max_completion_tokens"] = 1
    return primer


def build_app(upstreams: Sequence[str], encoder: str | None = None) -> Starlette:
    """The front: a relay over ``upstreams``, and with ``encoder`` vLLM's EPD proxy."""
    pool = Upstreams(upstreams)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))

    async def relay(request: Request) -> Response:
        raw = await request.body()
        if encoder is not None and request.url.path == "/v1/chat/completions":
            chat = json.loads(raw)
            if has_mm_input(chat):
                primed = await client.post(encoder + "/v1/chat/completions", json=encoder_request(chat))
                if primed.status_code != 200:
                    return JSONResponse({"error": {"message": f"encoder: {primed.text[:500]}"}},
                                        status_code=primed.status_code)
        upstream = pool.pick()
        assert upstream is not None
        pool.started(upstream)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            sent = client.build_request(request.method, upstream.url + request.url.path, content=raw, headers=headers)
            answer = await client.send(sent, stream=True)
        except BaseException:
            pool.finished(upstream)
            raise

        async def relayed() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
                pool.finished(upstream)

        kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(relayed(), status_code=answer.status_code, headers=kept)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    routes = [Route("/health", health), Route("/{path:path}", relay, methods=["GET", "POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epd_fronts", description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("lor", "vllm-epd"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", action="append", required=True, help="a vLLM replica (repeat for more)")
    parser.add_argument("--encoder", help="vllm-epd: vLLM's encoder instance (its EC producer)")
    args = parser.parse_args(argv)
    if (args.kind == "vllm-epd") != (args.encoder is not None):
        parser.error("--encoder goes with vllm-epd, and only with it")
    app = build_app(args.upstream, args.encoder)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
