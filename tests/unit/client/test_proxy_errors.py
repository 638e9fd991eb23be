"""The proxy's error table (``_proxy_errors``): every exception the rewrite raises is an
OpenAI-shaped 4xx or 5xx, as before the table (issue 31), and the app answers it so; without a
network (the app under httpx's ASGI transport, encode-server a scripted client)."""

from __future__ import annotations

import ast
import asyncio
import base64
import inspect
import json
from typing import Any

import httpx
import pytest
from encode_client import AsyncClient, ReplicaUnavailable, Result, ServerError, _proxy_rewrite, epd
from encode_client._base import Call
from encode_client._proxy_errors import REWRITE_ERRORS, rewrite_refusal, upstream_refusal
from encode_client.epd import EpdContract, EpdContractError, EPDError
from encode_client.proxy import ProxyApp, ProxySettings

from tests.server import free_port

WHERE = "messages[0].content[0]"
REWRITE_CASES: list[tuple[Exception, int, str, str | None]] = [
    (EPDError("a client's uuid is refused", WHERE), 400, "invalid_request_error", WHERE),
    (EPDError("the body must be a JSON object"), 400, "invalid_request_error", None),
    (json.JSONDecodeError("Expecting value", "{", 1), 400, "invalid_request_error", None),
    (ValueError("not a number"), 400, "invalid_request_error", None),
    (EpdContractError("no family"), 502, "encoder_error", None),
    (ServerError(400, "invalid_image", "bad", 0), 400, "encoder_error", None),
    (ServerError(401, "unauthorized", "no key"), 401, "encoder_error", None),
    (ServerError(409, "no_shared_tier", "no Redis"), 409, "encoder_error", None),
    (ServerError(413, "too_large", "big"), 413, "encoder_error", None),
    (ServerError(429, "rate_limited", "slow down"), 429, "encoder_error", None),
    (ServerError(500, "internal", "bug"), 503, "encoder_error", None),
    (ServerError(503, "overloaded", "queue full"), 503, "encoder_error", None),
    (ServerError(504, "timeout", "slow"), 503, "encoder_error", None),
    (ReplicaUnavailable("http://e:8000", "refused"), 503, "encoder_unavailable", None),
]


@pytest.mark.parametrize(("exc", "status", "kind", "param"), REWRITE_CASES, ids=lambda v: type(v).__name__)
def test_each_exception_of_the_rewrite_is_the_openai_error_it_was(
    exc: Exception, status: int, kind: str, param: str | None
) -> None:
    assert isinstance(exc, REWRITE_ERRORS)
    refused = rewrite_refusal(exc)
    assert (refused.status, refused.kind, refused.param) == (status, kind, param)
    body = json.loads(bytes(refused.response().body))
    assert body == {"error": {"message": refused.message, "type": kind, "param": param, "code": status}}
    assert str(exc) in refused.message


def test_the_cases_cover_every_class_the_table_names() -> None:
    assert {type(exc) for exc, *_ in REWRITE_CASES} >= set(REWRITE_ERRORS)


def _raised_classes(module: Any) -> set[type]:
    """The classes ``module`` raises by name (``raise Name(...)``)."""
    names = {node.exc.func.id for node in ast.walk(ast.parse(inspect.getsource(module)))
             if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)}
    return {value for name in names if isinstance(value := getattr(module, name, None), type)}


def test_every_class_the_rewrite_raises_is_in_the_table() -> None:
    raised = _raised_classes(epd) | _raised_classes(_proxy_rewrite)
    assert raised >= {EPDError, EpdContractError}
    # TypeError: a contract argument that is not one, the caller's bug (a 500 internal_error)
    assert all(issubclass(cls, REWRITE_ERRORS) for cls in raised - {TypeError}), raised


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (httpx.PoolTimeout("no connection"), 503, "overloaded_error"),
    (httpx.ReadTimeout("slow"), 504, "upstream_timeout"),
    (httpx.WriteTimeout("slow"), 504, "upstream_timeout"),
    (httpx.RemoteProtocolError("reset"), 502, "upstream_unavailable"),
    (httpx.ReadError("broken"), 502, "upstream_unavailable"),
], ids=lambda v: type(v).__name__)
def test_each_error_sending_to_vllm_is_the_openai_error_it_was(exc: httpx.HTTPError, status: int, kind: str) -> None:
    refused = upstream_refusal(exc, "http://vllm:8000", 600.0)
    assert (refused.status, refused.kind) == (status, kind)
    assert refused.response().headers.get("retry-after") == ("1" if status == 503 else None)
    assert "http://vllm:8000" in refused.message or status == 503


# -- the app answers them so ------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n not decoded here"
CHAT = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}]}]}
QWEN = EpdContract("pixel_free", {"image": ("image_grid_thw",)})


class _Encoder(AsyncClient):
    """encode-server answering every hand-off with ``answer`` (an exception, or meta to encode with)."""

    def __init__(self, answer: Exception | dict[str, Any]) -> None:
        super().__init__("http://encode-server.invalid", response="json")
        self.answer = answer

    async def _send(self, call: Call) -> Any:
        if call.op == "model":
            return [{"id": "clip", "family": {"name": "clip"}}]  # a family no vLLM prefill consumes
        if isinstance(self.answer, Exception):
            return self.answer
        return [Result(0, item.hash, "encoded", None, 8, (), None, meta=self.answer) for item in call.payload]


def _post(encoder: _Encoder, body: bytes, contract: EpdContract | None = QWEN, **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        app = ProxyApp(ProxySettings((f"http://127.0.0.1:{free_port()}",), ("http://encode-server.invalid",),
                                     connect_timeout=2.0))
        await app.startup()
        app._encoders = {None: encoder}
        app._contract = contract
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                return await client.post("/v1/chat/completions", content=body, headers=headers)
        finally:
            await app.shutdown()
            await encoder.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("answer", [ServerError(409, "no_shared_tier", "no Redis"),
                                    ServerError(400, "invalid_image", "unreadable"),  # naming no item
                                    ServerError(409, "no_shared_tier", "no Redis", 0),  # not the item's fault
                                    ReplicaUnavailable("http://encode-server.invalid", "refused")],
                         ids=lambda v: f"{type(v).__name__}")
def test_the_app_answers_encode_servers_refusal_by_the_table(answer: Exception) -> None:
    refused = rewrite_refusal(answer)
    got = _post(_Encoder(answer), json.dumps(CHAT).encode())
    error = got.json()["error"]
    assert got.status_code == refused.status
    assert (error["type"], error["param"], error["code"]) == (refused.kind, None, refused.status)
    assert str(answer) in error["message"]


@pytest.mark.parametrize("answer", [ServerError(400, "invalid_image", "cannot identify image file", 0),
                                    ServerError(413, "image_too_large", "12000x12000 pixels", 0)],
                         ids=["invalid_image", "image_too_large"])
def test_an_image_encode_server_refuses_is_a_400_naming_its_part(answer: ServerError) -> None:
    got = _post(_Encoder(answer), json.dumps(CHAT).encode())
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", WHERE, 400)
    assert f"encode-server refused this image: {answer.status} {answer.type}: {answer.message}" in error["message"]


@pytest.mark.parametrize(("body", "words"), [
    (b"", "request body is empty; expected a JSON chat completion request"),
    (b" \r\n", "request body is empty; expected a JSON chat completion request"),
    (b"{not json", "request body is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
                   "column 2); expected a JSON chat completion request"),
    (b"{\"model\": \"\xff\"}", "request body is not UTF-8 text; expected a JSON chat completion request"),
    (b"[1]", "request body must be a JSON object, got an array; expected a JSON chat completion request"),
    (b"null", "request body must be a JSON object, got null"),
], ids=["empty", "blank", "bad_json", "not_utf8", "array", "null"])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_what_was_expected(body: bytes, words: str) -> None:
    got = _post(_Encoder({"image_grid_thw": [1, 4, 4]}), body)
    error = got.json()["error"]
    assert got.status_code == 400 and (error["type"], error["param"]) == ("invalid_request_error", None)
    assert words in error["message"], error["message"]
    assert "Expecting value" not in error["message"]


def test_headers_over_the_cap_are_a_431_naming_the_flag() -> None:
    # the app's exact count (a head that arrived whole); tests/integration/test_proxy_serving.py sends
    # one too large to arrive whole over a socket
    got = _post(_Encoder({"image_grid_thw": [1, 4, 4]}), json.dumps(CHAT).encode(), **{"X-Big": "a" * (64 * 1024)})
    error = got.json()["error"]
    assert got.status_code == 431 and got.headers["connection"] == "close"
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, 431)
    assert "--max-header-bytes" in error["message"] and "65536" in error["message"]
    fits = _post(_Encoder({"image_grid_thw": [1, 4, 4]}), json.dumps(CHAT).encode(), **{"X-Big": "a" * 60_000})
    assert fits.status_code == 502, "under the cap: on to vLLM (none here)"


def test_a_model_no_prefill_consumes_is_a_502_and_no_vllm_a_502_after_the_rewrite() -> None:
    # the contract read from GET /v1/model: a family no vLLM prefill consumes
    model_free = _post(_Encoder({"image_grid_thw": [1, 4, 4]}), json.dumps(CHAT).encode(), contract=None)
    assert model_free.status_code == 502 and model_free.json()["error"]["type"] == "encoder_error"
    assert "which no vLLM prefill consumes" in model_free.json()["error"]["message"]
    unreachable = _post(_Encoder({"image_grid_thw": [1, 4, 4]}), json.dumps(CHAT).encode())
    assert unreachable.status_code == 502 and unreachable.json()["error"]["type"] == "upstream_unavailable"
    assert "vLLM server unreachable" in unreachable.json()["error"]["message"]

