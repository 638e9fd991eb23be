"""The request-head cap of the HTTP door (``api/connections.py``), on a stand-in for uvicorn's
protocol: what is counted as a head, what is not, and what a refused client reads."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from encode_server.api.connections import ConnectionLimits, guarded_protocol, head_end

CAP = 1024


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.eof = self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class FakeUvicorn(asyncio.Protocol):
    """What the guard relies on of uvicorn's protocol: ``connections``, ``transport``, ``cycle``."""

    def __init__(self) -> None:
        self.connections: set[Any] = set()
        self.fed = b""
        self.cycle: Any = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.fed += data

    def on_response_complete(self) -> None:
        pass


def opened() -> tuple[Any, FakeTransport]:
    cls = guarded_protocol(FakeUvicorn, ConnectionLimits(10, 10, 100, 5, max_header_bytes=CAP), None)
    proto, transport = cls(), FakeTransport()
    proto.connection_made(transport)
    return proto, transport


def head(size: int) -> bytes:
    start = b"GET / HTTP/1.1\r\nx-big: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def run(scenario: Any) -> None:
    async def main() -> None:
        scenario()

    asyncio.run(main())


def test_head_end_finds_the_blank_line_either_way_it_is_written() -> None:
    assert head_end(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nbody") == len(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert head_end(b"GET / HTTP/1.1\nhost: x\n\nbody") == len(b"GET / HTTP/1.1\nhost: x\n\n")
    assert head_end(b"GET / HTTP/1.1\r\nhost: x\r\n") == -1


def test_a_head_at_the_limit_passes_and_one_byte_more_is_431_naming_the_flag() -> None:
    def scenario() -> None:
        proto, transport = opened()
        proto.data_received(head(CAP))
        assert proto.fed == head(CAP) and transport.written == b""
        proto, transport = opened()
        proto.data_received(head(CAP + 1))
        assert proto.fed == b"", "the parser never saw the head"
        status, _, body = transport.written.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 ")
        assert json.loads(body)["error"] == {
            "type": "headers_too_large", "index": None,
            "message": f"request headers are above the limit of {CAP} bytes (--max-header-bytes)",
        }
        assert transport.eof and not transport.closed  # the client may still be sending: it reads the 431
        proto.data_received(b"a" * 10_000)
        assert proto.fed == b"" and transport.written.count(b"HTTP/1.1") == 1  # dropped, not answered again

    run(scenario)


def test_a_head_that_never_ends_is_refused_once_past_the_limit_not_held() -> None:
    def scenario() -> None:
        proto, transport = opened()
        proto.data_received(b"GET / HTTP/1.1\r\nx-big: ")
        for _ in range(CAP // 100 + 2):
            proto.data_received(b"a" * 100)
            if transport.written:
                break
        assert transport.written.startswith(b"HTTP/1.1 431 ")
        assert len(proto.fed) <= CAP

    run(scenario)


def test_a_blank_line_split_across_reads_ends_the_head() -> None:
    def scenario() -> None:
        proto, transport = opened()
        whole = head(CAP - 10)
        proto.data_received(whole[:-3])
        proto.data_received(whole[-3:] + b"x" * (4 * CAP))  # the body that follows is not a head
        assert transport.written == b"" and proto.fed == whole + b"x" * (4 * CAP)

    run(scenario)


def test_a_body_larger_than_the_limit_after_a_small_head_is_not_counted_and_the_next_head_is() -> None:
    def scenario() -> None:
        proto, transport = opened()
        proto.data_received(b"POST / HTTP/1.1\r\ncontent-length: 5000\r\n\r\n" + b"x" * 3000)
        proto.data_received(b"x" * 2000)
        assert transport.written == b""
        proto.cycle = SimpleNamespace(more_body=False, response_complete=True, response_started=True)
        proto.on_response_complete()  # the request was read whole: the next bytes are a head
        proto.data_received(b"GET / HTTP/1.1\r\nx-big: " + b"a" * CAP)
        assert transport.written.startswith(b"HTTP/1.1 431 ")

    run(scenario)


def test_a_response_sent_before_the_body_was_read_leaves_the_rest_of_the_body_uncounted() -> None:
    """A 413 answered from ``Content-Length`` alone: what the client still sends is its body."""

    def scenario() -> None:
        proto, transport = opened()
        proto.data_received(b"POST / HTTP/1.1\r\ncontent-length: 100000\r\n\r\n")
        proto.cycle = SimpleNamespace(more_body=True, response_complete=True, response_started=True)
        proto.on_response_complete()
        proto.data_received(b"x" * (4 * CAP))
        assert transport.written == b""

    run(scenario)
