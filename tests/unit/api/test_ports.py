"""The front doors never share a port: ``SO_REUSEPORT`` stays off on both (``api/ports.py``)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

import encode_server.api.grpc as grpc_door
from encode_server.api.ports import PortUnavailable, bind_listener
from encode_server.api.runtime import Runtime
from encode_server.config import Settings
from encode_server.metrics import Metrics
from tests.server import free_port


def test_grpc_refuses_a_port_held_with_reuseport_even_past_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-check skipped, so grpc-core's own bind decides: a port another gRPC server holds
    (grpc-core's default, ``SO_REUSEPORT`` on) must not be shared."""
    monkeypatch.setattr(grpc_door, "check_bindable", lambda *_args: None)
    port = free_port()

    async def scenario() -> None:
        other = grpc.aio.server()  # grpc-core's defaults, as a second replica had them
        assert other.add_insecure_port(f"127.0.0.1:{port}") == port
        await other.start()
        try:
            with pytest.raises(PortUnavailable, match=f"127.0.0.1:{port} \\(--grpc-port\\)"):
                server = await grpc_door.start_grpc_server(Runtime(Settings(grpc_port=port), Metrics()))
                await server.stop(None)
        finally:
            await other.stop(None)

    asyncio.run(scenario())


def test_a_listener_holds_its_port_against_another_reuseaddr_bind() -> None:
    held = bind_listener("HTTP", "--port", "127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(PortUnavailable, match=f"HTTP cannot listen on 127.0.0.1:{port} \\(--port\\)"):
            bind_listener("HTTP", "--port", "127.0.0.1", port)
        with socket.socket() as other:  # what uvicorn's own bind does
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
    finally:
        held.close()
