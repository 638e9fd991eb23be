"""500 mixed requests from 64 concurrent clients over HTTP and gRPC at once: hits, misses,
duplicate images inside and across requests, hash-only items, bad items. Every answer for one
image is the same bytes, and equals its single-request result (from another server: the model is
deterministic) up to float32 rounding of a batched forward pass; every bad item gets its 4xx
naming it; each distinct image is encoded once; all within a bounded time."""

from __future__ import annotations

import asyncio
import base64
import random
import time

import grpc
import httpx
import numpy as np
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import b64, h, metric, server_errors
from tests.images import image_bytes
from tests.robust.conftest import ROBUST_ARGS
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration

REQUESTS, CLIENTS, IMAGES, WARM = 500, 64, 40, 10
BOUND_S = 180


def build_plan(rng: random.Random, images: list[bytes]) -> list[tuple[str, list[tuple[str, object]]]]:
    """(door, items); an item is ("data", i), ("hash", i), ("unknown", hash) or ("bad", kind)."""
    plan = []
    for n in range(REQUESTS):
        door = "grpc" if n % 2 else "http"
        items: list[tuple[str, object]] = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            i = rng.randrange(IMAGES)
            if roll < 0.55:
                items.append(("data", i))
            elif roll < 0.8:
                items.append(("hash", i))
            else:
                items.append(("unknown", f"{rng.getrandbits(256):064x}"))
        if rng.random() < 0.3:
            items.append(items[rng.randrange(len(items))])  # a duplicate inside the request
        if rng.random() < 0.08:
            items.insert(rng.randrange(len(items) + 1), ("bad", rng.choice(["base64", "image"])))
        plan.append((door, items))
    return plan


def test_500_mixed_requests_from_64_clients_over_http_and_grpc(robust_server: ServerProcess, robust_logs) -> None:
    rng = random.Random(1234)
    images = [image_bytes("PNG", 40 + 4 * (i % 10), 40 + 3 * (i // 10), seed=90_000 + i) for i in range(IMAGES)]
    # Single-request results, from another server process.
    reference = {}
    for i, data in enumerate(images):
        item = httpx.post(robust_server.url + "/v1/encode", json={"items": [{"data": b64(data)}]}, timeout=60)
        reference[i] = base64.b64decode(item.json()["items"][0]["embedding"])
    plan = build_plan(rng, images)
    # The robust servers' 2 s header and body timeouts (the slow-client tests' subject) would close
    # a storm connection whose client, 64 coroutines on one starved event loop, sends its request
    # late: an httpx ReadError at load 11 in make test on 2026-12-06, nothing wrong on the server.
    # This test is about concurrent answers, so its server gives a client 30 s for each (the
    # default body timeout; headers default to 10 s).
    storm = start_server(*ROBUST_ARGS, "--max-connections", "256", "--header-timeout", "30", "--body-timeout", "30",
                         log_dir=robust_logs)
    try:
        for start in range(0, WARM, 5):  # --max-items 8
            warm = httpx.post(storm.url + "/v1/encode",
                              json={"items": [{"data": b64(d)} for d in images[start : start + 5]]}, timeout=60)
            assert warm.status_code == 200, warm.text
        encoded_before = metric(storm, "encode_server_batch_size_sum")
        failures: list[str] = []
        seen: dict[object, bytes] = {}

        async def http_call(client: httpx.AsyncClient, items: list[tuple[str, object]]) -> list[object]:
            body = []
            for kind, v in items:
                if kind == "data":
                    body.append({"data": b64(images[v])})  # type: ignore[index]
                elif kind == "hash":
                    body.append({"hash": h(images[v])})  # type: ignore[index]
                elif kind == "unknown":
                    body.append({"hash": v})
                else:
                    body.append({"data": "@@not base64@@" if v == "base64" else b64(b"not an image")})
            r = await client.post("/v1/encode", json={"items": body})
            if r.status_code != 200:
                e = r.json()["error"]
                return [("error", r.status_code, e["type"], e["index"])]
            return [(i["status"], base64.b64decode(i["embedding"]) if "embedding" in i else None)
                    for i in r.json()["items"]]

        async def grpc_call(stub: pb_grpc.EncoderStub, items: list[tuple[str, object]]) -> list[object]:
            msg = []
            for kind, v in items:
                if kind == "data":
                    msg.append(pb.Item(data=images[v]))  # type: ignore[index]
                elif kind == "hash":
                    msg.append(pb.Item(hash=h(images[v])))  # type: ignore[index]
                elif kind == "unknown":
                    msg.append(pb.Item(hash=str(v)))
                else:
                    msg.append(pb.Item(data=b"not an image"))
            try:
                resp = await stub.Encode(pb.EncodeRequest(items=msg), timeout=120)
            except grpc.aio.AioRpcError as exc:
                md = dict(exc.trailing_metadata() or ())
                status = {grpc.StatusCode.INVALID_ARGUMENT: 400}.get(exc.code(), exc.code())
                return [("error", status, md.get("error-type"), int(md["error-index"]))]
            return [(i.status, i.embedding.data if i.status != "miss" else None) for i in resp.items]

        def check(items: list[tuple[str, object]], got: list[object]) -> None:
            bad = [n for n, (kind, _) in enumerate(items) if kind == "bad"]
            if bad:
                assert got[0][:2] == ("error", 400), got[0]
                kind = items[bad[0]][1]
                door_types = {"invalid_base64", "invalid_image"} if kind == "base64" else {"invalid_image"}
                assert got[0][2] in door_types and got[0][3] in bad, (items, got)
                return
            assert len(got) == len(items), (items, got)
            for (kind, v), (status, data) in zip(items, got, strict=True):
                if kind == "unknown":
                    assert (status, data) == ("miss", None)
                elif kind == "hash" and status == "miss":
                    assert v >= WARM  # type: ignore[operator]  # never sent by anyone yet: a miss is right
                else:
                    assert status in ("hit", "encoded"), (kind, status)
                    # Within the storm every answer for one image is the same bytes (one encode,
                    # then the cache); against a single-image forward pass, a batched one may differ
                    # in the last bit of a float32 (batched matmul), never more.
                    first = seen.setdefault(v, data)  # type: ignore[arg-type]
                    assert data == first, f"item {v}: two answers in the storm differ"
                    got_f = np.frombuffer(data, "<f4")  # type: ignore[arg-type]
                    ref_f = np.frombuffer(reference[v], "<f4")
                    assert got_f.shape == ref_f.shape and np.allclose(got_f, ref_f, rtol=1e-5, atol=1e-6), (
                        f"item {v}: not its single-request result (max diff {np.abs(got_f - ref_f).max()})")

        async def storm_run() -> float:
            sem = asyncio.Semaphore(CLIENTS)
            # A connection per request: with keep-alive a request could go out on a connection the server
            # was closing after its 5 s idle timeout (a ReadError under load, twice in make test on
            # 2026-12-05, the second with idle connections dropped after 2 s: a client stalled past the
            # server's 5 s before it read the answer). The race is the client's, not the server's.
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=storm.url, timeout=120, limits=limits) as client, \
                    grpc.aio.insecure_channel(storm.grpc_target) as channel:
                stub = pb_grpc.EncoderStub(channel)

                async def one(door: str, items: list[tuple[str, object]]) -> None:
                    async with sem:
                        got = await (http_call(client, items) if door == "http" else grpc_call(stub, items))
                    try:
                        check(items, got)
                    except AssertionError as exc:
                        failures.append(f"{door} {items}: {exc}")

                started = time.monotonic()
                await asyncio.wait_for(asyncio.gather(*(one(d, it) for d, it in plan)), BOUND_S)
                return time.monotonic() - started

        took = asyncio.run(storm_run())
        assert not failures, failures[:5]
        uploaded = {v for _, items in plan for kind, v in items if kind == "data"}
        encoded = metric(storm, "encode_server_batch_size_sum") - encoded_before  # images through the model
        assert encoded == len(uploaded - set(range(WARM))), "an image was encoded more than once (or never)"
        assert server_errors(storm) == 0
        assert metric(storm, "encode_server_connections_closed_total") == 0  # no limit cut a client off
        assert metric(storm, "encode_server_queue_depth") == 0
        assert metric(storm, "encode_server_cache_pinned_bytes", '{tier="local"}') == 0
        print(f"{REQUESTS} requests from {CLIENTS} clients in {took:.1f} s; {int(encoded)} encodes")
    finally:
        assert storm.stop() == 0, storm.log()[-3000:]
