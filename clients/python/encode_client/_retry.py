"""One backoff and one retry policy, shared by every call, sync or async (redis-py's habit).

Pure: they compute delays and decisions; the clients do the sleeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from encode_client._errors import ReplicaUnavailable, ServerError

__all__ = ["Backoff", "Limits", "RetryPolicy"]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with "equal jitter": half the step fixed, half random, so retries
    from many clients spread out but none comes back immediately."""

    base: float = 0.1
    cap: float = 5.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        step = min(self.cap, self.base * 2 ** max(0, attempt - 1))
        return step / 2 + (rng or random).uniform(0, step / 2)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry 503/504 answers and unreachable replicas, never any other error.

    A ``Retry-After`` from the server is honoured as given (up to ``max_retry_after``), with up
    to 10% jitter added; otherwise the backoff decides. An unreachable replica is marked down for
    ``down_for`` seconds and its items fail over to their next replica at once, without sleeping.
    """

    max_retries: int = 4
    backoff: Backoff = field(default_factory=Backoff)
    max_retry_after: float = 30.0
    down_for: float = 5.0

    def retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, ServerError):
            return exc.retryable
        return isinstance(exc, ReplicaUnavailable)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random | None = None) -> float:
        if retry_after is not None and retry_after > 0:
            wait = min(retry_after, self.max_retry_after)
            return wait + (rng or random).uniform(0, wait * 0.1)
        return self.backoff.delay(attempt, rng)


@dataclass(frozen=True)
class Limits:
    """How the client splits work into requests (keep under the server's --max-items and
    --max-request-bytes; base64 in JSON adds a third to upload bytes)."""

    max_items: int = 64
    max_upload_bytes: int = 16 * 1024 * 1024


