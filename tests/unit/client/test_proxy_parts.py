"""The proxy's pure parts: choosing an upstream (least outstanding requests, marks that expire),
telling a request vLLM failed before answering from one it answered, and reading an answer only as
far as that."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from encode_client._proxy_forward import HeadBroken, read_head
from encode_client._upstreams import Upstreams
from encode_client._vllm_failure import StreamGate, is_generation_error

GENERIC = json.dumps({"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_least_busy_upstream_is_picked_and_ties_take_turns() -> None:
    ups = Upstreams(["http://a", "http://b", "http://c"])
    picks = [ups.pick().url for _ in range(6)]
    assert picks == ["http://a", "http://b", "http://c"] * 2, "idle upstreams share requests in turn"
    a, b, c = ups.all
    ups.started(a)
    ups.started(a)
    ups.started(b)
    assert ups.pick() is c
    ups.started(c)
    assert ups.pick() in (b, c) and ups.pick(exclude={"http://b", "http://c"}) is a
    ups.finished(a)
    ups.finished(a)
    assert ups.pick() is a
    assert ups.pick(exclude={"http://a", "http://b", "http://c"}) is None


def test_a_failed_upstream_is_avoided_until_its_mark_expires_and_used_when_alone() -> None:
    clock = Clock()
    ups = Upstreams(["http://a", "http://b"], down_for=5, clock=clock)
    a, b = ups.all
    ups.failed(a)
    assert not ups.up(a) and [ups.pick() for _ in range(3)] == [b, b, b]
    ups.started(b)
    ups.started(b)
    assert ups.pick() is b, "a busy live upstream before an idle one marked down"
    assert ups.pick(exclude={"http://b"}) is a, "marked down, but the only one left: tried anyway"
    clock.now = 6
    assert ups.up(a) and ups.pick() is a


def test_outstanding_never_goes_negative_and_urls_are_checked() -> None:
    ups = Upstreams(["http://a"])
    with pytest.raises(AssertionError):
        ups.finished(ups.all[0])
    for bad in ([], ["ftp://a"], ["http://a", "http://a/"]):
        with pytest.raises(ValueError):
            Upstreams(bad)


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


ROLE = _chunk({"role": "assistant", "content": ""})
TOKEN = _chunk({"content": "cat"})


def test_vllms_generic_500_is_a_failure_and_nothing_else_is() -> None:
    assert is_generation_error(500, GENERIC.encode())
    assert not is_generation_error(500, b'{"error": {"type": "BadRequestError"}}')
    assert not is_generation_error(500, b"<html>oops</html>")
    assert not is_generation_error(400, GENERIC.encode())


def test_a_stream_failed_before_content_is_held_back_whole() -> None:
    gate = StreamGate()
    assert gate.feed(ROLE) == b"" and gate.holding
    assert gate.feed(b"data: " + GENERIC.encode() + b"\n\ndata: [DONE]\n\n") == b""
    assert gate.failed and not gate.holding and gate.finish() == b""


def test_a_stream_with_content_is_released_from_its_first_byte_and_then_passes() -> None:
    gate = StreamGate()
    assert gate.feed(ROLE[:10]) == b""  # an event split across reads
    assert gate.feed(ROLE[10:]) == b""
    out = gate.feed(TOKEN[:5])
    assert out == b"" and gate.holding
    assert gate.feed(TOKEN[5:]) == ROLE + TOKEN
    assert gate.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and not gate.failed


@pytest.mark.parametrize(
    "event",
    [b"data: [DONE]\n\n", _chunk({}, "stop"), b"data: not json\n\n",
     b'data: {"error": {"type": "BadRequestError"}}\n\n',
     b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3}}).encode() + b"\n\n"],
    ids=["done", "finish", "unreadable", "other-error", "usage"],
)
def test_anything_but_a_role_chunk_or_vllms_failure_decides_for_passing(event: bytes) -> None:
    gate = StreamGate()
    gate.feed(ROLE)
    assert gate.feed(event) == ROLE + event and not gate.failed


def test_a_stream_that_says_nothing_decisive_is_released_past_the_limit_or_at_its_end() -> None:
    gate = StreamGate(limit=100)
    assert gate.feed(b": keep-alive\n\n") == b""
    assert gate.feed(ROLE * 3) == b": keep-alive\n\n" + ROLE * 3
    short = StreamGate()
    short.feed(ROLE)
    assert short.finish() == ROLE and not short.failed


# -- reading an answer's head, apart from the forward's retries (``_proxy_forward.read_head``) --


Answer = tuple[int, str, AsyncIterator[bytes]]


def _answer(status: int, content_type: str, *chunks: bytes, broken: bool = False) -> Answer:
    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
        if broken:
            raise aiohttp.ClientPayloadError("reset")

    return status, content_type, stream()


async def _read(answer: Answer) -> tuple[bytes, bytes, bool]:
    head = await read_head(*answer)
    return head.prefix, b"".join([chunk async for chunk in head.rest]), head.failed


@pytest.mark.parametrize(("answer", "read"), [
    (lambda: _answer(200, "text/event-stream", ROLE, b"data: " + GENERIC.encode() + b"\n\n", b"data: [DONE]\n\n"),
     (b"", b"data: [DONE]\n\n", True)),
    (lambda: _answer(200, "text/event-stream", ROLE, TOKEN, b"data: [DONE]\n\n"),
     (ROLE + TOKEN, b"data: [DONE]\n\n", False)),
    (lambda: _answer(500, "application/json", GENERIC.encode()), (GENERIC.encode(), b"", True)),
    (lambda: _answer(500, "application/json", b'{"error": {"type": "BadRequestError"}}'),
     (b'{"error": {"type": "BadRequestError"}}', b"", False)),
    (lambda: _answer(200, "application/json", b'{"choices": []}'), (b"", b'{"choices": []}', False)),
], ids=["stream-failed", "stream-content", "500-generic", "500-other", "200-unread"])
def test_an_answers_head_says_whether_vllm_failed_the_request_and_keeps_every_byte(
    answer: Callable[[], Answer], read: tuple[bytes, bytes, bool]
) -> None:
    assert asyncio.run(_read(answer())) == read


def test_a_stream_that_breaks_before_its_first_event_is_a_broken_head() -> None:
    with pytest.raises(HeadBroken):
        asyncio.run(_read(_answer(200, "text/event-stream", ROLE, broken=True)))


def test_a_500_whose_body_breaks_is_a_broken_head_and_a_long_one_is_relayed_whole() -> None:
    """A broken 500 body is the forward's 502 (its upstream given back), not an unhandled error;
    a 500 body over the limit is read no further than it and relayed, every byte, as not failed."""
    with pytest.raises(HeadBroken):
        asyncio.run(_read(_answer(500, "application/json", b'{"error": ', broken=True)))
    chunk = b"x" * (1 << 19)
    prefix, rest, failed = asyncio.run(_read(_answer(500, "application/json", chunk, chunk, chunk)))
    assert (len(prefix), len(rest), failed) == (1 << 20, 1 << 19, False)
