"""``SmallHitPath``: a small hash-only safetensors hit answered in one ASGI call, byte for byte what
the full stack answers, and every other request handed to the full stack with its body replayed,
answered and counted there once. A real service (the built-in tiny tower) with a real local tier."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from encode_server.api.hits import SMALL_BODY, SmallHitPath
from encode_server.api.http import create_app, safetensors_answer
from encode_server.api.runtime import Runtime
from encode_server.app import build_service
from encode_server.config import Settings
from encode_server.core.types import Embedding, EncodedTensor, ItemResult
from encode_server.encoders import load_encoder
from encode_server.logs import ACCESS_LOGGER
from encode_server.metrics import Metrics
from encode_server.service import EncodeService

SAFETENSORS = "application/vnd.safetensors"
HIT = "ab" * 32
OTHER_HIT = "cd" * 32
UNKNOWN = "ef" * 32


class Stack:
    """One runtime served two ways: ``full`` (FastAPI and its middlewares) and ``fast``
    (``SmallHitPath`` in front of the same app), counting the answers the fast path renders."""

    def __init__(self, **settings: Any) -> None:
        self.settings = Settings(model="builtin:tiny", **settings)
        self.runtime = Runtime(self.settings, Metrics())
        encoder = load_encoder("builtin:tiny", device="cpu", dtype="float32")
        service = build_service(encoder, self.settings, self.runtime.metrics, ThreadPoolExecutor(1))
        self.runtime.service = service
        for h, rows in ((HIT, 3), (OTHER_HIT, 2)):
            tensor = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
            service.local.put(service.key_for(h), Embedding(EncodedTensor(tensor.tobytes(), (rows, 8), "float32"), {}))
        self.full = create_app(self.runtime)
        self.rendered = 0

        def render(service: EncodeService, results: list[ItemResult]) -> list[bytes]:
            self.rendered += 1
            return safetensors_answer(service, results)

        self.fast = SmallHitPath(self.full, self.runtime, render)

    def metric(self, name: str, **labels: str) -> float:
        value = self.runtime.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


def call(
    app: Any, body: bytes | list[bytes], *, accept: str = SAFETENSORS, content_type: str = "application/json",
    headers: dict[str, str] | None = None, method: str = "POST", path: str = "/v1/encode",
) -> tuple[int, dict, bytes]:
    """One request as uvicorn makes it; (status, headers, body)."""
    chunks = body if isinstance(body, list) else [body]
    sent: list[dict] = []
    pending = list(chunks)

    async def receive() -> dict:
        if not pending:
            await asyncio.sleep(3600)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    raw = {"content-type": content_type, "accept": accept, "content-length": str(sum(map(len, chunks))),
           "x-request-id": "req-1", **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.encode(), v.encode()) for k, v in raw.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def hashes(*hs: str, **extra: Any) -> bytes:
    return json.dumps({"items": [{"hash": h} for h in hs], **extra}).encode()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    yield Stack()


@pytest.mark.parametrize("body", [hashes(HIT), hashes(HIT, OTHER_HIT, HIT), hashes(HIT, **{"return": "embeddings"})])
def test_a_small_hit_is_answered_here_byte_for_byte_as_the_full_stack(stack: Stack, body: bytes) -> None:
    before = stack.rendered
    full = call(stack.full, body)
    assert stack.rendered == before  # the full stack alone does not come here
    fast = call(stack.fast, body)
    assert stack.rendered == before + 1  # answered by the fast path
    assert full[0] == fast[0] == 200
    assert full == fast
    assert fast[1][b"x-request-id"] == b"req-1"


def test_a_hit_is_counted_and_logged_as_the_full_stack_counts_it(
    stack: Stack, caplog: pytest.LogCaptureFixture,
) -> None:
    def counts() -> tuple[float, ...]:
        return (
            stack.metric("encode_server_requests_total", route="/v1/encode", code="200"),
            stack.metric("encode_server_items_total", status="hit", source="local"),
            stack.metric("encode_server_cache_lookups_total", tier="local", result="hit"),
            stack.metric("encode_server_response_bytes_total"),
        )

    lines = []
    for app in (stack.full, stack.fast):
        first = counts()
        with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
            caplog.clear()
            _, _, body = call(app, hashes(HIT, HIT))
            lines.append([(r.getMessage().split(" id=")[0].rsplit(" ", 1)[0], r.fields["items"], r.fields["hits"])  # type: ignore[attr-defined]
                          for r in caplog.records if r.name == ACCESS_LOGGER])
        lines[-1].append(tuple(b - a for a, b in zip(first, counts(), strict=True)))
        assert lines[-1][-1][3] == len(body)
    assert lines[0] == lines[1]
    assert lines[1][0] == ("POST /v1/encode 200 items=2 hits=2", 2, 2)
    assert lines[1][1][:3] == (1, 2, 1)  # one request, two items, one lookup of the one key


@pytest.mark.parametrize(
    ("why", "kwargs", "status"),
    [
        ("a miss", {"body": hashes(UNKNOWN)}, 200),
        ("a hit and a miss", {"body": hashes(HIT, UNKNOWN)}, 200),
        ("a malformed hash", {"body": hashes("xyz")}, 400),
        ("an extra field", {"body": hashes(HIT, extra=1)}, 422),
        ("an item with data", {"body": json.dumps({"items": [{"hash": HIT, "data": "AAAA"}]}).encode()}, 400),
        ("metadata asked", {"body": hashes(HIT, **{"return": "metadata"})}, 409),
        ("a JSON answer asked", {"body": hashes(HIT), "accept": "application/json"}, 200),
        ("not JSON", {"body": b"{nope"}, 400),
        ("a body in pieces", {"body": [hashes(HIT)[:10], hashes(HIT)[10:]]}, 200),
        ("a large body", {"body": hashes(HIT) + b" " * SMALL_BODY}, 200),
        ("a raw upload", {"body": b"\x89PNG", "content_type": "image/png"}, 400),
    ],
)
def test_anything_else_gets_the_full_stacks_answer(stack: Stack, why: str, kwargs: dict[str, Any], status: int) -> None:
    before = stack.rendered
    requests = stack.metric("encode_server_requests_total", route="/v1/encode", code=str(status))
    full, fast = call(stack.full, **kwargs), call(stack.fast, **kwargs)
    assert stack.rendered == before, why
    assert fast[0] == status, fast
    assert (fast[0], fast[2]) == (full[0], full[2])
    assert stack.metric("encode_server_requests_total", route="/v1/encode", code=str(status)) == requests + 2


def test_a_wrong_api_key_is_refused_and_counted_once() -> None:
    stack = Stack(api_keys="t1:secret")
    good = call(stack.fast, hashes(HIT), headers={"authorization": "Bearer secret"})
    assert good[0] == 200 and stack.rendered == 1
    status, headers, body = call(stack.fast, hashes(HIT), headers={"authorization": "Bearer wrong"})
    assert (status, json.loads(body)["error"]["type"], headers[b"www-authenticate"]) == (401, "unauthorized", b"Bearer")
    assert call(stack.fast, hashes(HIT))[0] == 401  # no key at all
    assert stack.metric("encode_server_rejected_total", reason="unauthorized") == 2
    assert stack.rendered == 1


def test_a_full_budget_or_a_drain_is_answered_by_the_full_stack() -> None:
    stack = Stack(max_inflight_mb=1)
    budget = stack.runtime.budget
    assert budget.capacity is not None
    budget.acquire(budget.capacity)
    status, headers, body = call(stack.fast, hashes(HIT))
    assert (status, json.loads(body)["error"]["type"], headers[b"retry-after"]) == (503, "overloaded", b"1")
    budget.release(budget.capacity)
    assert call(stack.fast, hashes(HIT))[0] == 200
    assert budget.used == 0  # the hit's body was charged and given back
    stack.runtime.draining = True
    status, _, body = call(stack.fast, hashes(HIT))
    assert (status, json.loads(body)["error"]["type"]) == (503, "not_ready")
    assert stack.rendered == 1


def test_other_routes_and_methods_pass_through(stack: Stack) -> None:
    assert call(stack.fast, b"", method="GET", path="/health")[0] == 200
    assert call(stack.fast, b"", method="GET")[0] == 405
    assert call(stack.fast, json.dumps({"hashes": [HIT]}).encode(), path="/v1/lookup")[0] == 200
