"""The HTTP status of each domain error, in one place: HTTP answers with it, and gRPC labels its
request metrics with it so that one error-ratio alert covers both front doors."""

from __future__ import annotations

from encode_server.core.errors import (
    BadInput,
    Conflict,
    EncodeServerError,
    InvalidRequest,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)

__all__ = ["STATUS", "status_for"]

STATUS: tuple[tuple[type[EncodeServerError], int], ...] = (
    (BadInput, 400),
    (Unauthorized, 401),
    (Conflict, 409),
    (TooLarge, 413),
    (UnsupportedMediaType, 415),
    (InvalidRequest, 422),
    (Unavailable, 503),
    (Timeout, 504),
)


def status_for(exc: EncodeServerError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500
