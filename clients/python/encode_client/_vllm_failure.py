"""Telling a request that vLLM failed before answering it, the one the proxy may retry, from an answer.

vLLM 0.32 ends a request whose encoder input its EC connector could not obtain with
``finish_reason: "error"`` (its scheduler's ``take_unavailable_requests``: "retryable: re-issuing
the request re-runs the encode"). Its OpenAI server then answers, with no word of the cause:

- without streaming: ``500 {"error": {"message": "Internal server error", "type": "InternalServerError", ...}}``;
- streaming: ``200``, a chunk with the assistant's role and no content, then
  ``data: {"error": {... "type": "InternalServerError" ...}}``, then ``data: [DONE]``.

So the proxy holds a stream's first events until one decides it (``StreamGate``): content, the
end, or anything it does not recognise lets the stream through from its first byte; vLLM's
generic error before any content means the request produced nothing and may be retried. No I/O.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["StreamGate", "is_generation_error"]

_GENERIC = "InternalServerError"


def _is_generic_error(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    err = obj.get("error", obj)
    return isinstance(err, dict) and err.get("type") == _GENERIC


def is_generation_error(status: int, body: bytes) -> bool:
    """Whether a complete non-streaming answer is vLLM's generic failure of a request."""
    if status != 500:
        return False
    try:
        return _is_generic_error(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        return False


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _classify(event: bytes) -> str:
    """``preamble`` (a role-only chunk, or no data), ``error`` (vLLM's generic failure) or ``decided``."""
    data = _event_data(event)
    if data is None:
        return "preamble"  # a comment or keep-alive line
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return "decided"  # [DONE], or something this gate does not read: let it through
    if _is_generic_error(obj):
        return "error"
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or obj.get("usage"):
        return "decided"
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return "decided"
        if any(v not in (None, "") for k, v in delta.items() if k != "role"):
            return "decided"
    return "preamble"


class StreamGate:
    """Holds an SSE stream until its first deciding event (at most ``limit`` bytes).

    ``feed(chunk)`` returns the bytes to send now (nothing while holding); ``failed`` is True once
    vLLM's generic error came before any content (then nothing was released and the caller may
    retry); ``finish()`` returns what is still held when the stream ends."""

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self.failed = False
        self._passing = False
        self._held = bytearray()
        self._scanned = 0

    @property
    def holding(self) -> bool:
        return not self._passing and not self.failed

    def feed(self, chunk: bytes) -> bytes:
        if self._passing:
            return chunk
        if self.failed:
            return b""
        self._held += chunk
        while True:
            end = self._next_boundary()
            if end is None:
                break
            kind = _classify(bytes(self._held[self._scanned : end]))
            self._scanned = end
            if kind == "error":
                self.failed = True
                return b""
            if kind == "decided":
                return self._release()
        return self._release() if len(self._held) > self.limit else b""

    def finish(self) -> bytes:
        return b"" if self.failed else self._release()

    def _next_boundary(self) -> int | None:
        rest = self._held[self._scanned :]
        found = [(i, n) for sep, n in ((b"\n\n", 2), (b"\r\n\r\n", 4)) if (i := rest.find(sep)) >= 0]
        if not found:
            return None
        i, n = min(found)
        return self._scanned + i + n

    def _release(self) -> bytes:
        self._passing = True
        out, self._held = bytes(self._held), bytearray()
        return out
