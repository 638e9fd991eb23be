"""The hot routes' dispatch (``HotRoutes``) and body reading, through real ASGI calls on a real
FastAPI app: the same answers as the FastAPI routes, every exception accounted for."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from encode_server.api.bodies import read_body
from encode_server.api.http import HotRoutes
from encode_server.core.budget import OverBudget
from encode_server.core.errors import BadInput

Handler = Callable[[Request], Awaitable[Response]]


def call(app: Any, method: str, path: str, chunks: list[bytes], headers: dict[str, str] | None = None) -> list[dict]:
    """One request through ``app`` as uvicorn makes it: the body in ``chunks``."""
    sent: list[dict] = []
    pending = list(chunks) or [b""]

    async def receive() -> dict:
        if not pending:
            await asyncio.sleep(3600)
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    return sent


def answer(sent: list[dict]) -> tuple[int, Any]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else None


def hot(handler: Handler) -> HotRoutes:
    fallback = FastAPI()

    @fallback.get("/v1/encode")
    async def other_method() -> dict[str, str]:
        return {"from": "fastapi"}

    return HotRoutes(fallback, {"/v1/encode": handler})


def test_a_post_goes_to_its_handler_and_anything_else_to_fastapi() -> None:
    async def handler(request: Request) -> Response:
        return JSONResponse({"from": "hot", "body": (await request.body()).decode()})

    app = hot(handler)
    assert answer(call(app, "POST", "/v1/encode", [b"ab", b"cd"])) == (200, {"from": "hot", "body": "abcd"})
    assert answer(call(app, "GET", "/v1/encode", [])) == (200, {"from": "fastapi"})
    assert answer(call(app, "POST", "/v1/other", []))[0] == 404


def test_a_domain_error_is_answered_as_the_fastapi_routes_answer_it() -> None:
    async def handler(request: Request) -> Response:
        raise BadInput("not an image", type="invalid_image", index=2)

    status, body = answer(call(hot(handler), "POST", "/v1/encode", [b"x"]))
    assert status == 400
    assert body == {"error": {"type": "invalid_image", "message": "not an image", "index": 2}}


@pytest.mark.parametrize("error", [OverBudget(10, 0, 100), RuntimeError("bug")])
def test_other_exceptions_go_up_to_the_middleware_that_answers_them(error: Exception) -> None:
    """OverBudget to the budget middleware (503), the unexpected to Starlette's outermost (500):
    as from a FastAPI route, never swallowed into a wrong answer here."""

    async def handler(request: Request) -> Response:
        raise error

    with pytest.raises(type(error)):
        call(hot(handler), "POST", "/v1/encode", [b"x"])


class TestReadBody:
    @staticmethod
    def read(chunks: list[bytes], declared: int | None, limit: int = 1 << 20) -> bytes:
        got: list[bytes] = []

        async def handler(request: Request) -> Response:
            got.append(await read_body(request, limit))
            return Response()

        headers = {"content-length": str(declared)} if declared is not None else {}
        status, body = answer(call(hot(handler), "POST", "/v1/encode", chunks, headers))
        if status != 200:
            raise AssertionError(body)
        return got[0]

    @pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
    def test_a_body_in_pieces_is_read_whole(self, declared: bool) -> None:
        pieces = [bytes([i]) * (1000 + 37 * i) for i in range(40)]
        whole = b"".join(pieces)
        assert self.read(pieces, len(whole) if declared else None) == whole

    def test_a_body_in_one_piece_is_the_piece_itself(self) -> None:
        assert self.read([b"abc"], 3) == b"abc"
        assert self.read([], 0) == b""

    @pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
    def test_a_body_past_the_limit_is_refused(self, declared: bool) -> None:
        pieces = [b"x" * 600, b"y" * 600]
        with pytest.raises(AssertionError, match="payload_too_large"):
            self.read(pieces, 1200 if declared else None, limit=1000)
        with pytest.raises(AssertionError, match="payload_too_large"):
            self.read([b"x" * 1001], None, limit=1000)
