"""``AsyncClient(http="aiohttp")`` (``_aio``, the EPD proxy's) answers as the httpx path does: the
same parsed answer, a server's error as ``ServerError``, and a replica that refuses the connection
as ``ReplicaUnavailable``, so the flow fails over to the next one."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from encode_client import AsyncClient, ReplicaUnavailable, ServerError
from encode_client._retry import RetryPolicy

from tests.server import free_port

MODEL = {"model": "m", "hidden_size": 8}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        failing = self.headers.get("authorization") == "Bearer bad"
        status, body = (401, {"error": {"type": "authentication_error", "message": "no"}}) if failing else (200, MODEL)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def _model(urls: list[str], api_key: str | None = None, retries: int = 0) -> dict[str, object]:
    retry = RetryPolicy(max_retries=retries)
    async with AsyncClient(urls, http="aiohttp", api_key=api_key, timeout=5, retry=retry) as client:
        return await client.model()


def test_an_answer_is_parsed_and_a_refused_replica_fails_over(live: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert asyncio.run(_model([live])) == MODEL
    for urls in ([dead, live], [live, dead]):  # whichever the flow tries first
        assert asyncio.run(_model(urls, retries=1)) == MODEL
    with pytest.raises(ReplicaUnavailable):
        asyncio.run(_model([dead]))


def test_a_servers_error_is_a_server_error(live: str) -> None:
    with pytest.raises(ServerError) as raised:
        asyncio.run(_model([live], api_key="bad"))
    assert raised.value.status == 401 and raised.value.type == "authentication_error"
