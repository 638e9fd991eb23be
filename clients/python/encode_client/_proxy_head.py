"""The cap on a request's head (its request line and headers, ``--max-header-bytes``), kept in two
places because neither alone holds it:

- the connection (``head_capped_protocol``): uvicorn's httptools protocol buffers a head without
  limit, so one that is still incomplete past the cap is answered 431 there and the connection
  closed, its bytes never read whole (a 200 MB header costs the proxy one read, not 200 MB);
- the application (``head_bytes``, checked by the app): a head over the cap that arrived whole in
  one read is counted exactly, and answered 431 like any other refusal.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from encode_client._proxy_errors import error_body

__all__ = ["HEAD_FLAG", "head_bytes", "head_capped_protocol", "head_refusal"]

log = logging.getLogger("encode_client.proxy")

HEAD_FLAG = "--max-header-bytes"
_LINGER_S = 2.0  # how long a refused head's connection is read (and dropped) for its 431 to arrive


def head_refusal(limit: int, size: int | None = None) -> tuple[str, str]:
    """The 431's message (``size``: the head's, None for one refused before its end) and its
    OpenAI error type."""
    seen = f"{size} bytes, over" if size is not None else "over"
    return (f"the request's headers are {seen} the proxy's limit of {limit} bytes on a request line and its headers "
            f"({HEAD_FLAG})", "invalid_request_error")


def head_bytes(scope: Mapping[str, Any]) -> int:
    """The size of an ASGI request's head as it came on the wire (its request line, each header's
    ``name: value`` and CRLF), to the byte but for whitespace the parser dropped."""
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    line = len(scope.get("method", "")) + target + len(" ?HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


def head_capped_protocol(limit: int, refused: Callable[[], None]) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol answering 431 (and closing) once a head still incomplete has
    brought more than ``limit`` bytes; ``refused`` is called for each. None without httptools:
    uvicorn's h11 protocol is then used, its ``h11_max_incomplete_event_size`` set to ``limit``
    (a 400 from uvicorn for such a head)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - uvicorn without httptools (PyPy)
        return None
    message, kind = head_refusal(limit)
    body = json.dumps(error_body(431, message, kind)).encode()
    answer = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body

    class HeadCappedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """Counts the bytes of each head as they arrive: from a message's end (or the connection's
        start) to its head's end. The count runs after each read is parsed, so a read that ends a
        head under the cap and carries a body is never refused, and one head costs at most the
        cap and one read."""

        _head: int | None = 0  # bytes of the head being read; None while a body is
        _refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:  # read and dropped until the client closes, or the linger ends
                return
            if self._head is not None:
                self._head += len(data)
            super().data_received(data)
            if self._head is not None and self._head > limit and not self.transport.is_closing():
                self._refuse()

        def on_headers_complete(self) -> None:
            self._head = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._head = 0
            super().on_message_complete()

        def _refuse(self) -> None:
            refused()
            answering = self.cycle is not None and not self.cycle.response_complete
            log.info("- - 431 a request's head still incomplete after %d bytes (%s %d)%s", self._head, HEAD_FLAG,
                     limit, "" if not answering else "; the connection closed under the answer before it")
            if answering:  # a response under way on this connection: the 431 cannot follow it in order
                self.transport.close()
                return
            # A close with the client's bytes unread would reset the connection, and the reset can
            # overtake the 431 on its way: the answer is sent, the writing side shut, and what the
            # client still sends is read and dropped until it closes (or _LINGER_S have passed).
            self._refused = True
            self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(_LINGER_S, self.transport.close)

    return HeadCappedProtocol
