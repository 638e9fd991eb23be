"""Logging set-up: text for people, one JSON object per line for machines (``--log-format``).

The access log is ours (one line per request, written by the HTTP middleware with the request id,
route, code, items, hits and duration); uvicorn's own access log is off so nothing is logged twice.
A log record may carry structured fields in ``extra={"fields": {...}}``: the JSON formatter puts
them at the top level, the text formatter leaves them in the message they were formatted into.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

__all__ = ["ACCESS_LOGGER", "JsonFormatter", "LoggedAs", "TextFormatter", "configure_logging"]

ACCESS_LOGGER = "encode_server.access"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Seconds:
    """A timestamp's seconds, formatted once a second: every request writes an access line, and
    ``strftime`` per line was a tenth of the event loop's time under load."""

    def __init__(self, fmt: str, convert: Any) -> None:
        self._fmt, self._convert = fmt, convert
        self._last: tuple[int, str] = (-1, "")  # one tuple: read and replaced whole by any thread

    def __call__(self, created: float) -> str:
        second = int(created)
        last = self._last
        if last[0] != second:
            last = self._last = (second, time.strftime(self._fmt, self._convert(second)))
        return last[1]


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT`` with the logging module's own timestamp (local time, ``,msec``)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._seconds = _Seconds(self.default_time_format, self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": f"{self._seconds(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class LoggedAs(logging.Filter):
    """Log a logger's records under another name. uvicorn writes its start-up and shutdown lines
    to ``uvicorn.error`` (its name for "not the access log"), so that grepping a log for "error"
    found ``INFO uvicorn.error: Started server process``; they are logged as ``uvicorn``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logged_as = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = self.logged_as
        return True


def configure_logging(level: str, fmt: str) -> None:
    """Route every logger (uvicorn's included) through one root handler in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers[:] = []
        uv.propagate = True
    server_lines = logging.getLogger("uvicorn.error")
    for old in [f for f in server_lines.filters if isinstance(f, LoggedAs)]:
        server_lines.removeFilter(old)
    server_lines.addFilter(LoggedAs("uvicorn"))
