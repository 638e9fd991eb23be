"""The proxy's error table (``_proxy_errors``): every exception the rewrite raises is an
OpenAI-shaped 4xx or 5xx, and the app answers it so: every way the rewrite refuses a request is a
400 naming the part or field, never a 500; without a network (the app under httpx's ASGI transport,
encode-server a scripted client)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx
import pytest
from encode_client import AsyncClient, ReplicaUnavailable, Result, ServerError
from encode_client._base import Call
from encode_client._proxy_errors import REWRITE_ERRORS, NoConnectionFree, rewrite_refusal, upstream_refusal
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


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (NoConnectionFree(), 503, "overloaded_error"),
    (aiohttp.SocketTimeoutError("slow"), 504, "upstream_timeout"),
    (asyncio.TimeoutError(), 504, "upstream_timeout"),
    (aiohttp.ServerDisconnectedError(), 502, "upstream_unavailable"),
    (aiohttp.ClientPayloadError("broken"), 502, "upstream_unavailable"),
], ids=lambda v: type(v).__name__)
def test_each_error_sending_to_vllm_is_the_openai_error_it_was(exc: Exception, status: int, kind: str) -> None:
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
    """encode-server answering every hand-off with ``answer`` (an exception, meta to encode with, or
    a function of the item giving its ``Result``) and ``GET /v1/model`` with ``model`` (a family no
    vLLM prefill consumes unless told otherwise); counts the model reads."""

    def __init__(self, answer: Exception | dict[str, Any] | Callable[[Any], Result],
                 model: dict[str, Any] | None = None) -> None:
        super().__init__("http://encode-server.invalid", response="json")
        self.answer = answer
        self.model_answer = model or {"id": "clip", "family": {"name": "clip"}}
        self.model_reads = 0

    async def _send(self, call: Call) -> Any:
        if call.op == "model":
            self.model_reads += 1
            return [self.model_answer]
        if isinstance(self.answer, Exception):
            return self.answer
        if callable(self.answer):
            return [self.answer(item) for item in call.payload]
        return [Result(0, item.hash, "encoded", None, 8, (), None, meta=self.answer) for item in call.payload]


def _post(encoder: _Encoder, body: bytes, contract: EpdContract | None = QWEN, **headers: str) -> httpx.Response:
    return _posts(encoder, [body], contract, headers=headers)[0]


def _posts(encoder: _Encoder, bodies: list[bytes], contract: EpdContract | None = QWEN, *,
           headers: dict[str, str] | None = None, **settings: Any) -> list[httpx.Response]:
    """``bodies`` posted in turn to one proxy (``settings``: its ``ProxySettings``) whose vLLM does not
    answer; ``contract``: the one it holds already (None: it reads encode-server's)."""

    async def go() -> list[httpx.Response]:
        app = ProxyApp(ProxySettings((f"http://127.0.0.1:{free_port()}",), ("http://encode-server.invalid",),
                                     connect_timeout=2.0, **settings))
        await app.startup()
        app._encoders = {None: encoder}
        app._contract = contract
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                return [await client.post("/v1/chat/completions", content=b, headers=headers) for b in bodies]
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



# -- every way the rewrite refuses a request, through the app ---------------------------------------

def _data(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


IMAGE = {"type": "image_url", "image_url": {"url": _data("image/png", PNG)}}
VIDEO = {"type": "video_url", "video_url": {"url": _data("video/mp4", b"\x00\x00\x00\x18ftypmp42 v")}}
AUDIO = {"type": "audio_url", "audio_url": {"url": _data("audio/wav", b"RIFF a")}}
EVERY = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw",),
                                   "audio": ("audio_num_tokens",)}, {"video": {"second_per_grid_ts": "float32"}},
                    settings_enabled=True, settings={"max_pixels": {"type": "int", "modalities": ["image"]}})
META = {"image_grid_thw": [1, 4, 4], "video_grid_thw": [2, 4, 4], "audio_num_tokens": 9}
PART = "messages[0].content[1]"  # each case's media part, after a text part


def _chat(*parts: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "t"}, *parts]}],
            **fields}


def _answered(status: str = "encoded", key: str | None = None, meta: dict[str, Any] = META) -> Callable[[Any], Result]:
    return lambda item: Result(0, item.hash, status, None, 8, (), None, meta=meta, key=key)


# (body, contract, encode-server's answer, trust mm kwargs, the param the 400 names, words of its message)
REFUSALS: dict[str, tuple[dict[str, Any], EpdContract, Any, bool, str | None, str]] = {
    "client uuid": (_chat({**IMAGE, "uuid": "mine"}), EVERY, META, False, PART, "a client's uuid is refused"),
    "uuid on a text part": (_chat({"type": "text", "text": "x", "uuid": "mine"}), EVERY, META, False, PART,
                            "a client's uuid is refused"),
    "untyped part": (_chat({"image_url": IMAGE["image_url"]}), EVERY, META, False, PART, "needs a string 'type'"),
    "untrusted embeds": (_chat({"type": "image_embeds", "image_embeds": {}}), EVERY, META, False, PART,
                         "image_embeds parts from clients are refused"),
    "http url": (_chat({"type": "image_url", "image_url": {"url": "http://a/b.png"}}), EVERY, META, False, PART,
                 "only data: URLs"),
    "url not a string": (_chat({"type": "image_url", "image_url": {"url": 5}}), EVERY, META, False, PART,
                         "must be a string"),
    "not base64 url": (_chat({"type": "image_url", "image_url": {"url": "data:image/png,xx"}}), EVERY, META, False,
                       PART, "must be base64"),
    "bad base64": (_chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,!!"}}), EVERY, META,
                   False, PART, "not valid base64"),
    "input_audio without data": (_chat({"type": "input_audio", "input_audio": {}}), EVERY, META, False, PART,
                                 "input_audio.data must be"),
    "input_audio bad base64": (_chat({"type": "input_audio", "input_audio": {"data": "!!"}}), EVERY, META, False,
                               PART, "input_audio.data is not valid base64"),
    "messages not a list": ({"model": "m", "messages": {}}, EVERY, META, False, None, "messages must be a list"),
    "kv_transfer_params": (_chat(IMAGE, kv_transfer_params={"a": 1}), EVERY, META, False, "kv_transfer_params",
                           "KV transfer connector"),
    "ec_transfer_params": (_chat(IMAGE, ec_transfer_params={"a": 1}), EVERY, META, True, "ec_transfer_params",
                           "encoder-cache connector"),
    "untrusted mm kwargs": (_chat(IMAGE, mm_processor_kwargs={"max_pixels": 9}), EVERY, META, False,
                            "mm_processor_kwargs", "per-request processor settings are off"),
    "untrusted media io": (_chat(VIDEO, media_io_kwargs={"video": {"fps": 1}}), EVERY, META, False,
                           "media_io_kwargs", "media loading settings (a video's fps) are off"),
    "mm kwargs not an object": (_chat(IMAGE, mm_processor_kwargs=[1]), EVERY, META, True, "mm_processor_kwargs",
                                "must be an object"),
    "unknown setting": (_chat(IMAGE, mm_processor_kwargs={"fps": 1}), EVERY, META, True, "mm_processor_kwargs.fps",
                        "not a setting of the served family"),
    "setting off at the server": (_chat(IMAGE, mm_processor_kwargs={"max_pixels": 9}), QWEN, META, True,
                                  "mm_processor_kwargs", "encode-server takes no per-request processor settings"),
    "an image's media io": (_chat(IMAGE, media_io_kwargs={"image": {}}), EVERY, META, True, "media_io_kwargs.image",
                            "only video's sampling is taken"),
    "audio in video not a bool": (_chat(VIDEO, mm_processor_kwargs={"use_audio_in_video": 1}), EVERY, META, True,
                                  "mm_processor_kwargs.use_audio_in_video", "must be a boolean"),
    "audio in video undeclared": (_chat(VIDEO, mm_processor_kwargs={"use_audio_in_video": True}), EVERY, META, True,
                                  "mm_processor_kwargs.use_audio_in_video", "declares no audio_in_video"),
    "a modality the contract lacks": (_chat(VIDEO), QWEN, META, False, PART, "takes no video through the EPD path"),
    "audio for pixels + uuid": (_chat(AUDIO), EpdContract("pixels_uuid", {}), META, False, PART,
                                "takes no audio through the EPD path"),
    "image refused": (_chat(IMAGE), EVERY, ServerError(400, "invalid_image", "unreadable", 0), False, PART,
                      "encode-server refused this image: 400 invalid_image: unreadable"),
    "video refused": (_chat(VIDEO), EVERY, ServerError(400, "invalid_video", "no moov atom", 0), False, PART,
                      "encode-server refused this video: 400 invalid_video: no moov atom"),
    "audio refused": (_chat(AUDIO), EVERY, ServerError(413, "audio_too_long", "10 min", 0), False, PART,
                      "encode-server refused this audio: 413 audio_too_long: 10 min"),
    "not stored": (_chat(IMAGE), EVERY, _answered("miss"), False, PART, "holds no embedding for image"),
    "a key of another item": (_chat(VIDEO), EVERY, _answered(key="e:v1:" + "ab" * 32 + ":" + "cd" * 32), False,
                              PART, "answer does not name this video"),
    "meta without the fields": (_chat(AUDIO), EVERY, _answered(meta={}), False, PART,
                                "lacks ['audio_num_tokens']"),
    "a tensor field it cannot write": (_chat(VIDEO), EVERY, _answered(meta={**META, "second_per_grid_ts": "x"}),
                                       False, PART, "second_per_grid_ts for video"),
}


@pytest.mark.parametrize(("body", "contract", "answer", "trusted", "param", "words"), REFUSALS.values(),
                         ids=REFUSALS.keys())
def test_every_refusal_of_the_rewrite_is_a_400_naming_its_part_or_field(
    body: dict[str, Any], contract: EpdContract, answer: Any, trusted: bool, param: str | None, words: str
) -> None:
    """Whichever check refuses (the chat's, the contract's, encode-server's answer for one item), the
    caller gets OpenAI's 400 ``invalid_request_error`` naming where, never a 500 or a vLLM answer."""
    got = _posts(_Encoder(answer), [json.dumps(body).encode()], contract, trust_request_mm_kwargs=trusted)[0]
    error = got.json()["error"]
    assert got.status_code == 400, got.text
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)
    assert error["message"].startswith(f"{param}: " if param else ""), error["message"]
    assert words in error["message"], error["message"]


# -- the contract: read by the proxy, passed down to the rewrite --------------------------------------

QWEN_MODEL = {"id": "q", "family": {"name": "qwen2_vl", "epd": {"mode": "pixel_free",
                                                                "fields": {"image": ["image_grid_thw"]}}}}


def test_the_proxy_reads_the_contract_once_and_only_for_a_request_with_media() -> None:
    encoder = _Encoder({"image_grid_thw": [1, 4, 4]}, QWEN_MODEL)
    text = json.dumps(_chat()).encode()
    answers = _posts(encoder, [text, json.dumps(CHAT).encode(), json.dumps(CHAT).encode()], contract=None)
    assert [a.json()["error"]["type"] for a in answers] == ["upstream_unavailable"] * 3  # on to vLLM (none here)
    assert encoder.model_reads == 1


def test_a_contract_that_cannot_be_read_fails_only_requests_with_media_and_is_read_again_by_the_next() -> None:
    encoder = _Encoder({"image_grid_thw": [1, 4, 4]})  # serves a family no vLLM prefill consumes
    text, image = json.dumps(_chat()).encode(), json.dumps(CHAT).encode()
    answers = _posts(encoder, [text, image, image], contract=None)
    assert [a.json()["error"]["type"] for a in answers] == ["upstream_unavailable", "encoder_error", "encoder_error"]
    assert answers[1].status_code == 502 and encoder.model_reads == 2
