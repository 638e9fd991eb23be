"""The client's upload modes, driven without a network: the flow's calls are answered here."""

from __future__ import annotations

from typing import Any

import pytest
from encode_client import UploadStats
from encode_client._base import BaseClient, Call, HitWindow
from encode_client._http import build
from encode_client._images import WireItem, mm_hash
from encode_client._types import Result


def _answer(call: Call, cached: set[str]) -> list[Result]:
    out = []
    for h, data, *_ in call.payload:
        if data is None:
            status = "hit" if h in cached else "miss"
        else:
            status = "hit" if h in cached else "encoded"
            cached.add(h)
        out.append(Result(0, h, status, None, None, (), None))
    return out


def drive(client: BaseClient, images: list[bytes], cached: set[str]) -> tuple[list[Result], list[Call]]:
    """Run one encode flow; every call answered as a server holding ``cached`` would."""
    flow = client._encode_flow(images)
    calls: list[Call] = []
    try:
        step: Any = next(flow)
        while True:
            calls.extend(step)
            step = flow.send([_answer(c, cached) for c in step])
    except StopIteration as stop:
        return stop.value, calls


def test_window_says_hash_first_until_it_knows_then_follows_the_hit_rate() -> None:
    w = HitWindow(size=10, min_hit_rate=0.3, min_samples=4)
    assert w.hash_first() and w.hit_rate is None
    for _ in range(3):
        w.record(False)
    assert w.hash_first(), "three samples are not enough to decide"
    w.record(False)
    assert not w.hash_first()
    for _ in range(3):
        w.record(True)
    assert w.hit_rate == 3 / 7 and w.hash_first()
    for _ in range(10):
        w.record(False)
    assert w.hit_rate == 0.0, "only the last `size` outcomes count"


def test_adaptive_all_miss_traffic_stops_asking_first_and_says_so() -> None:
    client = BaseClient("http://a:1")
    cached: set[str] = set()
    round_trips = []
    for i in range(40):
        _, calls = drive(client, [b"image-%d" % i], cached)
        round_trips.append(len(calls))
    stats = client.stats
    assert isinstance(stats, UploadStats)
    assert stats.mode == "upload" and stats.switches == 1
    assert round_trips[:8] == [2] * 8, "hash-first while nothing is known"
    assert round_trips[8:] == [1] * 32, "then one round trip per image: bytes at once"
    assert stats.direct_items == 32 and stats.hash_first_items == 8 and stats.misses == 40


def test_adaptive_goes_back_to_hash_first_when_uploads_turn_out_to_be_hits() -> None:
    client = BaseClient("http://a:1")
    cached: set[str] = set()
    for i in range(16):
        drive(client, [b"new-%d" % i], cached)
    assert client.stats.mode == "upload"
    for _ in range(3):  # the same 16 images again: every upload answers "hit"
        for i in range(16):
            drive(client, [b"new-%d" % i], cached)
    assert client.stats.mode == "hash-first"
    _, calls = drive(client, [b"new-0"], cached)
    assert len(calls) == 1 and calls[0].payload[0].data is None, "a hit costs a hash, not the bytes"


def test_hash_first_mode_never_sends_bytes_for_a_cached_image_and_always_mode_never_asks() -> None:
    cached: set[str] = set()
    hf = BaseClient("http://a:1", upload="hash-first")
    for i in range(20):
        drive(hf, [b"x-%d" % i], cached)
    assert hf.stats.mode == "hash-first" and hf.stats.direct_items == 0
    always = BaseClient("http://a:1", upload="always")
    results, calls = drive(always, [b"x-1", b"x-2"], cached)
    assert len(calls) == 1 and all(item.data is not None for item in calls[0].payload)
    assert [r.status for r in results] == ["hit", "hit"]
    assert always.stats.uploaded_bytes == len(b"x-1") + len(b"x-2")


def test_uploads_travel_as_raw_bytes_not_base64_json() -> None:
    one = build("http://a:1", "encode", [WireItem("ab" * 32, b"\xff\xd8jpeg")], response="safetensors", api_key=None)
    assert one.content == b"\xff\xd8jpeg" and one.json is None
    assert one.headers["Content-Type"] == "application/octet-stream"
    two = [WireItem("a" * 64, b"one"), WireItem("b" * 64, b"two")]
    many = build("http://a:1", "encode", two, response="json", api_key="k")
    assert many.files is not None and [f[1][1] for f in many.files] == [b"one", b"two"] and many.json is None
    hashes = build("http://a:1", "encode", [WireItem("a" * 64, None)], response="json", api_key=None)
    assert hashes.json == {"items": [{"hash": "a" * 64}]}


def test_a_refused_upload_names_the_callers_item_not_its_place_in_the_request() -> None:
    """The client dedupes and sends only the misses: the server's index counts within that
    request, and the error the caller sees is turned back into the caller's own index."""
    from encode_client import ServerError

    client = BaseClient("http://a:1", upload="hash-first")
    cached_one, bad = b"cached", b"bad"
    flow = client._encode_flow([cached_one, cached_one, bad, bad])
    asked = next(flow)
    uploads = flow.send([_answer(c, {mm_hash(cached_one)}) for c in asked])
    assert [i.data for c in uploads for i in c.payload] == [bad]
    with pytest.raises(ServerError) as info:
        flow.send([ServerError(400, "invalid_image", "no", 0, replica="http://a:1")])
    assert (info.value.type, info.value.index) == ("invalid_image", 2)
    assert isinstance(info.value.__cause__, ServerError) and info.value.__cause__.index == 0
