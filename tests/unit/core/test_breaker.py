"""The circuit breaker and its backoff, on a fake clock: every transition and invariant."""

from __future__ import annotations

import pytest

from encode_server.core.breaker import Backoff, BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def no_jitter(base: float = 1.0, cap: float = 8.0) -> Backoff:
    return Backoff(base=base, cap=cap, jitter=0.0)


def breaker(clock: FakeClock, threshold: int = 3, probe_timeout: float = 5.0) -> CircuitBreaker:
    return CircuitBreaker(threshold, no_jitter(), probe_timeout=probe_timeout, clock=clock)


def test_backoff_doubles_up_to_its_cap_and_jitter_only_shortens() -> None:
    b = no_jitter(0.25, 4.0)
    assert [b.delay(n) for n in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.delay(10_000) == 4.0
    jittered = Backoff(base=1.0, cap=8.0, jitter=0.5, rng=lambda: 0.999)
    assert 0.5 < jittered.delay(0) <= 1.0
    with pytest.raises(ValueError):
        Backoff(base=2.0, cap=1.0)


def test_stays_closed_below_the_threshold_and_a_success_resets_the_count() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    cb.record_failure()
    cb.record_failure()
    cb.record_success()
    cb.record_failure()
    cb.record_failure()
    assert cb.state is BreakerState.CLOSED and cb.allow()


def test_opens_after_consecutive_failures_and_denies_until_the_cooldown() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    for _ in range(3):
        assert cb.allow()
        cb.record_failure()
    assert cb.state is BreakerState.OPEN
    assert not cb.allow() and cb.retry_in() == pytest.approx(1.0)
    clock.advance(0.999)
    assert not cb.allow()


def test_a_trip_opens_at_once_then_probes_as_after_any_opening() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    cb.trip()  # the start-up PING found the backend down: no call waits on it
    assert cb.state is BreakerState.OPEN and not cb.allow() and cb.retry_in() == pytest.approx(1.0)
    cb.trip()  # already open: the cooldown is not pushed back
    assert cb.retry_in() == pytest.approx(1.0)
    clock.advance(1.0)
    assert cb.allow() and cb.state is BreakerState.HALF_OPEN
    cb.record_success()
    assert cb.state is BreakerState.CLOSED


def test_half_open_grants_exactly_one_probe_and_a_success_closes() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    clock.advance(1.0)
    assert cb.allow()  # the probe
    assert cb.state is BreakerState.HALF_OPEN
    assert not cb.allow() and not cb.allow()  # one probe at a time
    cb.record_success()
    assert cb.state is BreakerState.CLOSED and cb.allow() and cb.consecutive_failures == 0


def test_a_failed_probe_reopens_with_a_longer_cooldown_capped() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    cooldowns = []
    for _ in range(6):
        cooldowns.append(cb.retry_in())
        clock.advance(cb.retry_in())
        assert cb.allow()
        cb.record_failure()  # one failure re-opens from half-open
        assert cb.state is BreakerState.OPEN
    assert cooldowns == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_success_resets_the_backoff() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    clock.advance(1.0)
    cb.allow()
    cb.record_failure()
    assert cb.retry_in() == 2.0
    clock.advance(2.0)
    cb.allow()
    cb.record_success()
    for _ in range(3):
        cb.record_failure()
    assert cb.retry_in() == 1.0


def test_a_probe_that_never_reports_does_not_wedge_the_breaker() -> None:
    clock = FakeClock()
    cb = breaker(clock, probe_timeout=5.0)
    for _ in range(3):
        cb.record_failure()
    clock.advance(1.0)
    assert cb.allow()  # this probe is cancelled and never reports
    clock.advance(4.9)
    assert not cb.allow()
    clock.advance(0.1)
    assert cb.allow()  # a new probe
    cb.record_success()
    assert cb.state is BreakerState.CLOSED


def test_late_failures_of_calls_allowed_before_opening_change_nothing() -> None:
    clock = FakeClock()
    cb = breaker(clock)
    for _ in range(3):
        cb.record_failure()
    before = cb.retry_in()
    cb.record_failure()
    cb.record_failure()
    assert cb.state is BreakerState.OPEN and cb.retry_in() == before
