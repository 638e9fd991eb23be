"""The proxy's hand-off memo on its own: bounded, expiring, keyed by modality, hash and settings;
and ``MemoClient``'s flow answers what it holds without a call, sends the rest, and keeps no miss.
The memo against a real encode-server and proxy: tests/integration/test_proxy_serving.py."""

from __future__ import annotations

from typing import Any

import pytest
from encode_client._handoff_memo import HandoffMemo, MemoClient, fresh_handoffs, memo_key
from encode_client._images import mm_hash
from encode_client._types import Result


def result(digest: str, status: str = "hit", index: int = 0) -> Result:
    return Result(index, digest, status, "redis", 4, (4, 8), "float32", {"image_grid_thw": [1, 4, 4]})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_and_the_least_recently_used_goes_first() -> None:
    clock, hits = Clock(), []
    memo = HandoffMemo(2, 10.0, on_hit=lambda: hits.append(1), clock=clock)
    a, b, c = (memo_key("image", d, None) for d in "abc")
    memo.put(a, result("a"))
    memo.put(b, result("b"))
    assert memo.get(a) is not None  # a is now the most recent
    memo.put(c, result("c"))
    assert memo.get(b) is None and memo.get(a) is not None and memo.get(c) is not None
    assert len(hits) == 3
    clock.now = 10.0
    assert memo.get(a) is None and len(memo) == 1, "expired at its deadline, and dropped"
    with pytest.raises(ValueError):
        HandoffMemo(0, 1.0)


def test_the_key_tells_modality_and_settings_apart() -> None:
    assert memo_key("image", "h", None) == memo_key("image", "h", {})
    assert memo_key("image", "h", {"a": 1, "b": 2}) == memo_key("image", "h", {"b": 2, "a": 1})
    assert len({memo_key("image", "h", None), memo_key("video", "h", None),
                memo_key("image", "h", {"max_pixels": 1}), memo_key("image", "g", None)}) == 4


def _drive(flow: Any, answer: Any) -> tuple[Any, list[Any]]:
    """Run a client flow, answering each round's calls with ``answer(call)``; the value and the calls."""
    calls: list[Any] = []
    try:
        step = next(flow)
        while True:
            calls += step
            step = flow.send([answer(c) for c in step])
    except StopIteration as stop:
        return stop.value, calls


def test_the_flow_sends_only_what_the_memo_lacks_and_keeps_no_miss() -> None:
    client = MemoClient("http://127.0.0.1:9", memo=HandoffMemo(8, 60.0), upload="always")
    one, two = b"image one bytes", b"image two bytes"
    held = result(mm_hash(one))
    client.memo.put(memo_key("image", mm_hash(one), None), held)
    sent: list[list[str]] = []

    def answer(call: Any) -> Any:
        items = list(call.payload)
        sent.append([i.hash for i in items])
        return [result(i.hash, "miss" if i.data == two else "encoded", n) for n, i in enumerate(items)]

    value, _ = _drive(client._encode_flow([two, one, two], "handoff", "image"), answer)
    assert sent == [[mm_hash(two)]], "only the image the memo lacks, once"
    assert [r.index for r in value] == [0, 1, 2] and value[1].hash == mm_hash(one) and value[1].status == "hit"
    assert client.memo.get(memo_key("image", mm_hash(two), None)) is None, "a miss is never kept"
    sent.clear()
    with fresh_handoffs():
        _drive(client._encode_flow([one], "handoff", "image"), answer)
    assert sent == [[mm_hash(one)]], "a retry's hand-off skips the memo"
    sent.clear()
    _drive(client._encode_flow([one], "encode", "image"), answer)
    assert sent == [[mm_hash(one)]], "only hand-offs read the memo"
