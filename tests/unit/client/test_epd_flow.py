"""The EPD rewrite is one flow of the client's calls that ``Client`` and ``AsyncClient`` drive as they
drive their own: the same body, results, errors and calls from both, with clients whose ``_send``
answers from a script instead of the network."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import pytest
from encode_client import AsyncClient, Client, Result, ServerError, mm_hash
from encode_client._base import Call
from encode_client.epd import (
    EpdContract,
    EpdContractError,
    EPDError,
    apply_results,
    check_chat_request,
    rewrite_chat_plan,
    rewrite_chat_plan_async,
    rewrite_chat_request,
    rewrite_chat_request_async,
)

PNG_A, PNG_B = b"\x89PNG\r\n\x1a\n a", b"\x89PNG\r\n\x1a\n b"
MP4_A, MP4_B = b"\x00\x00\x00\x18ftypmp42 a", b"\x00\x00\x00\x18ftypmp42 b"
QWEN3 = EpdContract("pixel_free", {"image": ("image_grid_thw",), "video": ("video_grid_thw", "timestamps")})
MODEL = {"id": "m", "family": {"name": "qwen3_vl", "epd": {"mode": "pixel_free", "fields": {
    "image": ["image_grid_thw"], "video": ["video_grid_thw", "timestamps"]}}}}
META = {"image": {"image_grid_thw": [1, 4, 4]}, "video": {"video_grid_thw": [2, 4, 4], "timestamps": [0.25, 1.25]}}


def _url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _url("image/png", data)}}


def video(data: bytes) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": _url("video/mp4", data)}}


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "t"}]}]}


class _Script:
    """encode-server as a function of each call: a hand-off item is encoded with its modality's
    meta, unless ``refuse`` maps its hash to the error to answer instead, or ``busy`` to how many
    times to answer 503 first. Records every call, and how many were in flight at once."""

    def __init__(
        self,
        refuse: dict[str, ServerError] | None = None,
        *,
        busy: dict[str, int] | None = None,
        model: dict[str, Any] = MODEL,
    ) -> None:
        self.refuse = refuse or {}
        self.busy = dict(busy or {})
        self.model = model
        self.calls: list[Call] = []
        self.in_flight = self.most_in_flight = 0

    def answer(self, call: Call) -> Any:
        self.calls.append(call)
        if call.op == "model":
            return [self.model]
        for item in call.payload:
            if self.busy.get(item.hash):
                self.busy[item.hash] -= 1
                return ServerError(503, "overloaded", "queue full", retry_after=0.01)
            if item.hash in self.refuse:
                return self.refuse[item.hash]
        return [Result(0, item.hash, "encoded", None, 8, (), None, meta=META[item.modality or "image"])
                for item in call.payload]


class _SyncScripted(Client):
    def __init__(self, script: _Script) -> None:
        super().__init__("http://encode-server.invalid", response="json")
        self.script = script

    def _send(self, call: Call) -> Any:
        self.script.in_flight += 1
        self.script.most_in_flight = max(self.script.most_in_flight, self.script.in_flight)
        try:
            return self.script.answer(call)
        finally:
            self.script.in_flight -= 1


class _AsyncScripted(AsyncClient):
    def __init__(self, script: _Script) -> None:
        super().__init__("http://encode-server.invalid", response="json")
        self.script = script

    async def _send(self, call: Call) -> Any:
        self.script.in_flight += 1
        self.script.most_in_flight = max(self.script.most_in_flight, self.script.in_flight)
        await asyncio.sleep(0)  # let the other hand-offs of the step start
        self.script.in_flight -= 1
        return self.script.answer(call)


def _both(body: dict[str, Any], refuse: dict[str, ServerError] | None = None, **kw: Any) -> list[Any]:
    """What the sync and the async rewrite give for ``body``: (body, results) or the exception."""
    outs: list[Any] = []
    for run in (_run_sync, _run_async):
        try:
            outs.append(run(body, _Script(refuse), **kw))
        except Exception as exc:  # compared below, by type and text
            outs.append(exc)
    return outs


def _run_sync(body: dict[str, Any], script: _Script, **kw: Any) -> Any:
    with _SyncScripted(script) as client:
        return rewrite_chat_request(body, client, **kw)


def _run_async(body: dict[str, Any], script: _Script, **kw: Any) -> Any:
    async def go() -> Any:
        async with _AsyncScripted(script) as client:
            return await rewrite_chat_request_async(body, client, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("parts", [
    (image(PNG_A), video(MP4_A), image(PNG_B), video(MP4_B)),
    (video(MP4_B), video(MP4_A)),
    (image(PNG_B), image(PNG_A)),
    ({"type": "text", "text": "no media"},),
], ids=["mixed", "videos", "images", "none"])
def test_both_rewrites_give_one_body_and_the_results_images_then_videos_in_request_order(
    parts: tuple[dict[str, Any], ...],
) -> None:
    body = chat(*parts)
    sync, asynchronous = _both(body, contract=QWEN3)
    assert sync == asynchronous
    plan = check_chat_request(body)
    rewritten, results = sync
    assert [r.hash for r in results] == [mm_hash(p.data) for p in plan.media]
    assert rewritten == apply_results(body, plan, results, QWEN3)  # each part from its own result
    for part in plan.media:
        kind = f"{part.modality}_embeds"
        rebuilt = rewritten["messages"][0]["content"][part.part]
        assert rebuilt["type"] == kind and rebuilt[kind] == META[part.modality]


def test_a_video_encode_server_refuses_is_named_by_its_part_in_both_rewrites() -> None:
    refused = {mm_hash(MP4_B): ServerError(400, "invalid_video", "no moov atom", 0)}
    outs = _both(chat(image(PNG_A), video(MP4_A), video(MP4_B)), refused, contract=QWEN3)
    for out in outs:
        assert isinstance(out, EPDError) and out.where == "messages[0].content[2]"
        assert "encode-server refused this video: 400 invalid_video: no moov atom" in str(out)


def test_an_image_encode_server_refuses_is_named_by_its_part_in_both_rewrites() -> None:
    # the images go in one call: the server's index (in the client's terms) says which part it was
    refused = {mm_hash(PNG_B): ServerError(400, "invalid_image", "cannot identify image file", 1)}
    outs = _both(chat(image(PNG_A), video(MP4_A), image(PNG_B)), refused, contract=QWEN3)
    for out in outs:
        assert isinstance(out, EPDError) and out.where == "messages[0].content[2]", out
        assert "encode-server refused this image: 400 invalid_image: cannot identify image file" in str(out)


@pytest.mark.parametrize(("status", "index"), [(409, 1), (429, 0), (500, None), (400, None)])
def test_an_image_refusal_that_is_not_the_images_fault_stays_the_servers_error(status: int, index: int | None) -> None:
    refused = {mm_hash(PNG_B): ServerError(status, "no_shared_tier", "x", index)}
    for out in _both(chat(image(PNG_A), image(PNG_B)), refused, contract=QWEN3):
        assert type(out) is ServerError and out.status == status


@pytest.mark.parametrize(("status", "index"), [(409, 0), (429, 0), (500, None), (400, None)])
def test_a_video_refusal_that_is_not_the_videos_fault_stays_the_servers_error(status: int, index: int | None) -> None:
    refused = {mm_hash(MP4_A): ServerError(status, "no_shared_tier", "x", index)}
    for out in _both(chat(video(MP4_A)), refused, contract=QWEN3):
        assert type(out) is ServerError and out.status == status


def test_of_several_failed_hand_offs_both_rewrites_raise_the_first_in_request_order() -> None:
    refused = {mm_hash(PNG_A): ServerError(409, "no_shared_tier", "images", None),
               mm_hash(MP4_A): ServerError(400, "invalid_video", "first video", 0),
               mm_hash(MP4_B): ServerError(400, "invalid_video", "second video", 0)}
    sync, asynchronous = _both(chat(video(MP4_A), image(PNG_A), video(MP4_B)), refused, contract=QWEN3)
    assert type(sync) is type(asynchronous) is ServerError and sync.status == asynchronous.status == 409
    del refused[mm_hash(PNG_A)]
    for out in _both(chat(video(MP4_B), image(PNG_A), video(MP4_A)), refused, contract=QWEN3):
        assert isinstance(out, EPDError) and out.where == "messages[0].content[0]" and "second video" in str(out)


def test_the_images_go_in_one_hand_off_and_each_video_in_its_own_all_at_once_with_the_async_client() -> None:
    """What encode-server sees: one request for the two images, one per video, nothing else (the
    contract was given), the same from both clients; the async client has all three in flight at once."""
    body = chat(image(PNG_A), video(MP4_A), image(PNG_B), video(MP4_B))
    scripts = {"sync": _Script(), "async": _Script()}
    sync = _run_sync(body, scripts["sync"], contract=QWEN3)
    assert _run_async(body, scripts["async"], contract=QWEN3) == sync
    for script in scripts.values():
        sent = sorted(([item.hash for item in call.payload], call.payload[0].modality) for call in script.calls)
        assert [call.op for call in script.calls] == ["handoff"] * 3
        assert sent == sorted([([mm_hash(PNG_A), mm_hash(PNG_B)], "image"), ([mm_hash(MP4_A)], "video"),
                               ([mm_hash(MP4_B)], "video")])
    assert scripts["async"].most_in_flight == 3 and scripts["sync"].most_in_flight == 1
    assert [r.hash for r in sync[1]] == [mm_hash(d) for d in (PNG_A, PNG_B, MP4_A, MP4_B)]


def test_a_hand_off_encode_server_asks_to_retry_is_sent_again_while_the_others_go_on() -> None:
    """A 503 on one video's hand-off is retried after its backoff; the other items' hand-offs are
    not sent again, and both clients give the same body."""
    for run in (_run_sync, _run_async):
        script = _Script(busy={mm_hash(MP4_A): 1})
        rewritten, results = run(chat(image(PNG_A), video(MP4_A), video(MP4_B)), script, contract=QWEN3)
        sent = [item.hash for call in script.calls for item in call.payload]
        assert sorted(sent) == sorted([mm_hash(PNG_A), mm_hash(MP4_A), mm_hash(MP4_A), mm_hash(MP4_B)])
        assert [r.hash for r in results] == [mm_hash(d) for d in (PNG_A, MP4_A, MP4_B)]
        assert rewritten["messages"][0]["content"][1]["video_embeds"] == META["video"]


def test_a_chat_without_media_asks_encode_server_nothing_and_one_without_a_contract_reads_it_first() -> None:
    text = chat({"type": "text", "text": "no media"})
    script = _Script()
    assert _run_sync(text, script) == _run_async(text, script)
    assert script.calls == []  # no media: no contract read, no call
    script = _Script()
    sync, asynchronous = (run(chat(video(MP4_A)), script) for run in (_run_sync, _run_async))
    assert sync == asynchronous and [c.op for c in script.calls] == ["model", "handoff"] * 2
    script = _Script()
    _run_sync(chat(video(MP4_A)), script, contract=QWEN3)
    assert [c.op for c in script.calls] == ["handoff"]  # a contract given is not read again


def test_a_contract_that_cannot_be_read_is_raised_by_both_rewrites_before_any_hand_off() -> None:
    script = _Script(model={"id": "clip", "family": {"name": "clip"}})  # a family no vLLM prefill consumes
    for run in (_run_sync, _run_async):
        with pytest.raises(EpdContractError, match="no vLLM prefill consumes"):
            run(chat(image(PNG_A)), script)
    assert [c.op for c in script.calls] == ["model", "model"]


def test_the_plan_drivers_take_a_checked_plan() -> None:
    body = chat(video(MP4_A), image(PNG_A))
    plan = check_chat_request(body)
    with _SyncScripted(_Script()) as client:
        sync = rewrite_chat_plan(body, plan, client, contract=QWEN3)

    async def go(run: Callable[..., Any]) -> Any:
        async with _AsyncScripted(_Script()) as client:
            return await run(body, plan, client, contract=QWEN3)

    assert asyncio.run(go(rewrite_chat_plan_async)) == sync
