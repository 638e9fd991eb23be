"""Logging set-up: text for people, one JSON object per line for machines (``--log-format``).

The access log is ours (one line per request, written by the HTTP middleware with the request id,
route, code, items, hits and duration); uvicorn's own access log is off so nothing is logged twice.
A log record may carry structured fields in ``extra={"fields": {...}}``: the JSON formatter puts
them at the top level, the text formatter leaves them in the message they were formatted into.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["ACCESS_LOGGER", "JsonFormatter", "LoggedAs", "configure_logging"]

ACCESS_LOGGER = "encode_server.access"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


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
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
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
