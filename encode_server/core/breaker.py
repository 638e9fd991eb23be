"""A circuit breaker and its backoff, pure: no I/O, no asyncio, a clock passed in.

Why: the shared tier is an accelerator. When Redis is down or stalled, every call would otherwise
spend its full timeout before failing; a breaker turns that into an instant miss after a few
failures, and lets one probe at a time find out when Redis is back (redis-py's ``backoff.py``
style: one backoff object, one policy, no ad-hoc loops).

States and transitions::

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN --(cooldown elapsed; allow() grants one probe)--> HALF_OPEN
    HALF_OPEN --(success)--> CLOSED        HALF_OPEN --(failure)--> OPEN (longer cooldown)

Invariants:
- ``allow()`` is True in CLOSED; in OPEN it is False until ``retry_at``; in HALF_OPEN at most one
  probe is outstanding, unless the previous one has not reported within ``probe_timeout`` (a
  cancelled probe must not wedge the breaker half-open forever).
- Any success closes the breaker and resets both the failure count and the backoff.
- Each consecutive re-opening waits ``backoff.delay(n)`` for n = 0, 1, 2, ...: non-decreasing up to
  ``backoff.cap`` (before jitter), so a dead Redis costs one probe per cap seconds, and a Redis that
  comes back is found within ``cap`` seconds (+ jitter).
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Backoff", "BreakerState", "CircuitBreaker"]


@dataclass(frozen=True)
class Backoff:
    """Exponential delay ``min(cap, base * 2**attempt)``, shortened by up to ``jitter`` of itself.

    Jitter spreads the probes of many replicas that lost Redis at the same moment. ``rng`` returns
    a float in [0, 1); pass a constant one in tests.
    """

    base: float = 0.25
    cap: float = 4.0
    jitter: float = 0.2
    rng: Callable[[], float] = field(default=random.random, compare=False)

    def __post_init__(self) -> None:
        if self.base <= 0 or self.cap < self.base or not 0 <= self.jitter < 1:
            raise ValueError(f"need 0 < base <= cap and 0 <= jitter < 1, got {self}")

    def delay(self, attempt: int) -> float:
        raw = self.cap if attempt >= 32 else min(self.cap, self.base * 2**attempt)
        return raw * (1.0 - self.jitter * self.rng())


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Closed -> open after consecutive failures -> half-open probe after a backoff -> closed.

    Not thread-safe; one event loop owns it. Callers ask ``allow()`` before a call and report the
    outcome with ``record_success()`` or ``record_failure()``.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        backoff: Backoff | None = None,
        *,
        probe_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or probe_timeout <= 0:
            raise ValueError("failure_threshold must be >= 1 and probe_timeout > 0")
        self.failure_threshold = failure_threshold
        self.backoff = backoff or Backoff()
        self.probe_timeout = probe_timeout
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive, while closed
        self._openings = 0  # consecutive re-openings without a success in between
        self._retry_at = 0.0
        self._probe_started: float | None = None

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def retry_in(self) -> float:
        """Seconds until ``allow()`` would grant a probe; 0 when closed or a probe is due now."""
        now = self._clock()
        if self._state is BreakerState.OPEN:
            return max(0.0, self._retry_at - now)
        if self._state is BreakerState.HALF_OPEN and self._probe_started is not None:
            return max(0.0, self._probe_started + self.probe_timeout - now)
        return 0.0

    def allow(self) -> bool:
        """May the caller talk to the backend now? In OPEN/HALF_OPEN a True is the probe."""
        now = self._clock()
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if now < self._retry_at:
                return False
            self._state = BreakerState.HALF_OPEN
            self._probe_started = now
            return True
        assert self._probe_started is not None
        if now - self._probe_started >= self.probe_timeout:
            self._probe_started = now
            return True
        return False

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._openings = 0
        self._probe_started = None

    def record_failure(self) -> None:
        if self._state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures < self.failure_threshold:
                return
        elif self._state is BreakerState.OPEN:
            return  # a call that was allowed before the breaker opened; it changes nothing
        self._open()

    def trip(self) -> None:
        """Open now, whatever the count: a check outside the calls (the start-up PING) found the
        backend down, so no request waits on it; the backoff then probes as after any opening."""
        if self._state is not BreakerState.OPEN:
            self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._retry_at = self._clock() + self.backoff.delay(self._openings)
        self._openings += 1
        self._failures = 0
        self._probe_started = None
