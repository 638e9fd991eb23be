"""Every answer the proxy gives itself instead of forwarding, OpenAI-shaped, and the one table of
what each exception of the rewrite and of the forward becomes::

    Refused                     raised anywhere in a request; the app answers its response
    rewrite_refusal(exc)        an exception of the rewrite (``REWRITE_ERRORS``):
        EPDError, ValueError        400 invalid_request_error (the request's fault; JSON included)
        EpdContractError            502 encoder_error (encode-server serves a model no prefill takes)
        ServerError                 its own 4xx, or 503 for a 5xx: encoder_error
        ReplicaUnavailable          503 encoder_unavailable
    upstream_refusal(exc, ...)  an error sending to vLLM (a refused connection fails over first):
        NoConnectionFree            503 overloaded_error (no connection free: --max-connections)
        asyncio.TimeoutError        504 upstream_timeout (aiohttp's ServerTimeoutError is one)
        aiohttp.ClientError         502 upstream_unavailable

Anything else is a bug, answered 500 ``internal_error`` and logged by the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from encode_client._errors import ReplicaUnavailable, ServerError
from encode_client.epd import EpdContractError, EPDError

__all__ = ["REWRITE_ERRORS", "NoConnectionFree", "Refused", "error_body", "openai_error", "rewrite_refusal",
           "upstream_refusal"]

# What the rewrite raises on purpose (``encode_client.epd``, and the body's JSON): each maps to a
# 4xx or 5xx in ``rewrite_refusal``.
REWRITE_ERRORS: tuple[type[Exception], ...] = (EPDError, ValueError, EpdContractError, ServerError, ReplicaUnavailable)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: a JSON answer's body, or a stream's last event."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def openai_error(status: int, message: str, kind: str, param: str | None = None, **headers: str) -> JSONResponse:
    """OpenAI's error body (a 401 asks for a bearer token, as OpenAI's does)."""
    body = error_body(status, message, kind, param)
    extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(body, status_code=status, headers={**extra, **headers})


class Refused(Exception):
    """An answer the proxy gives itself instead of forwarding: ``kind`` is its OpenAI error type
    (and the ``errors`` metric's label)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, **headers: str) -> None:
        super().__init__(f"{status} {kind}: {message}")
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers: Mapping[str, str] = headers

    def response(self) -> JSONResponse:
        return openai_error(self.status, self.message, self.kind, self.param, **self.headers)


def rewrite_refusal(exc: Exception) -> Refused:
    """The answer for ``exc``, one of ``REWRITE_ERRORS`` (the first class that matches, in order)."""
    match exc:
        case EPDError():
            return Refused(400, str(exc), "invalid_request_error", exc.where)
        case ValueError():  # json.JSONDecodeError is one
            return Refused(400, str(exc), "invalid_request_error")
        case EpdContractError():
            return Refused(502, f"encode-server: {exc}", "encoder_error")
        case ServerError():
            return Refused(exc.status if 400 <= exc.status < 500 else 503, f"encode-server: {exc}", "encoder_error")
        case ReplicaUnavailable():
            return Refused(503, f"encode-server unavailable: {exc}", "encoder_unavailable")
    raise TypeError(f"not an error of the rewrite: {exc!r}") from exc


class NoConnectionFree(Exception):
    """Every one of the ``--max-connections`` connections to vLLM stayed busy for
    ``--connect-timeout`` seconds."""


def upstream_refusal(exc: Exception, upstream: str, timeout: float) -> Refused:
    """The answer for an error sending a request to the vLLM server at ``upstream``."""
    match exc:
        case NoConnectionFree():
            return Refused(503, "no connection to vLLM free in time (--max-connections)", "overloaded_error",
                           **{"Retry-After": "1"})
        case asyncio.TimeoutError():
            return Refused(504, f"vLLM at {upstream} did not answer within {timeout} s", "upstream_timeout")
    return Refused(502, f"vLLM server at {upstream} failed: {exc!r}", "upstream_unavailable")
