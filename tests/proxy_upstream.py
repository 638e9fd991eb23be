"""A scripted stand-in for a vLLM OpenAI server, over real HTTP (uvicorn in a thread), for the
proxy's mechanics that a real vLLM cannot be made to show on demand: an answer that streams slowly,
requests held open to count outstanding ones, a request failed before answering.

Its failure is vLLM 0.32's own answer for a request its EC connector could not serve, byte for
byte in shape (tests/vllm/test_proxy.py checks the proxy recognises the real one): non-streaming,
``500 {"error": {"message": "Internal server error", "type": "InternalServerError", ...}}``;
streaming, a role chunk, ``data: {"error": ...}``, ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

__all__ = ["StubVllm"]

_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class StubVllm:
    """``fail_next``: how many chat requests to fail as vLLM does; ``token_delay``: seconds between
    streamed tokens. A request whose body has ``"hold": true`` waits before answering, and a stream
    with ``"hold_stream": true`` waits after its first token, until ``release()``."""

    name: str = "stub"
    tokens: int = 4
    token_delay: float = 0.0
    fail_next: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    served: int = 0
    streams_held: int = 0

    def __post_init__(self) -> None:
        self._release = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> StubVllm:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def release(self) -> None:
        self._release.set()

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = await self._answer(request)
        await response(scope, receive, send)

    async def _answer(self, request: Request) -> Response:
        if request.url.path == "/health":
            return Response(b"", status_code=200)
        if request.url.path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{"id": "stub", "owned_by": self.name}]})
        body = json.loads(await request.body())
        self.bodies.append(body)
        self.active += 1
        try:
            if body.get("hold"):
                while not self._release.is_set():
                    await asyncio.sleep(0.01)
            failing = self.fail_next > 0
            self.fail_next -= failing
            if body.get("stream"):
                return StreamingResponse(self._stream(failing, bool(body.get("hold_stream"))),
                                         media_type="text/event-stream")
            if failing:
                return JSONResponse(_ERROR, status_code=500)
            text = " ".join(f"t{i}" for i in range(self.tokens))
            self.served += 1
            return JSONResponse({"id": "chatcmpl-stub", "object": "chat.completion", "model": self.name,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": "length"}]})
        finally:
            self.active -= 1

    async def _stream(self, failing: bool, hold: bool) -> AsyncIterator[bytes]:
        yield _chunk({"role": "assistant", "content": ""})
        if failing:
            yield b"data: " + json.dumps(_ERROR).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        for i in range(self.tokens):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if hold and i == 1:
                self.streams_held += 1
                while not self._release.is_set():
                    await asyncio.sleep(0.01)
            yield _chunk({"content": f"t{i} "}, "length" if i == self.tokens - 1 else None)
        self.served += 1
        yield b"data: [DONE]\n\n"
