"""ByteBudget and Hold: never overdrawn, never negative, all-or-nothing charges, holds released once."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from encode_server.core.budget import ByteBudget, OverBudget


def test_a_charge_that_does_not_fit_changes_nothing() -> None:
    budget = ByteBudget(100)
    assert budget.try_acquire(60)
    assert not budget.try_acquire(41)
    assert budget.used == 60 and budget.available == 40
    assert budget.try_acquire(40) and budget.available == 0
    budget.check_invariants()


def test_a_charge_larger_than_the_capacity_never_fits_even_when_empty() -> None:
    budget = ByteBudget(100)
    assert not budget.could_ever_fit(101) and budget.could_ever_fit(100)
    assert not budget.fits(101) and not budget.try_acquire(101)
    with pytest.raises(OverBudget) as info:
        budget.acquire(101)
    assert info.value.asked == 101 and info.value.available == 100
    assert budget.used == 0


def test_releasing_more_than_is_held_is_an_error_not_a_clamp() -> None:
    budget = ByteBudget(100)
    budget.acquire(10)
    with pytest.raises(ValueError):
        budget.release(11)
    assert budget.used == 10


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_byte_counts_are_non_negative_ints(bad: object) -> None:
    budget = ByteBudget(100)
    with pytest.raises(ValueError):
        budget.try_acquire(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ByteBudget(bad)  # type: ignore[arg-type]


def test_an_unbounded_budget_counts_but_never_refuses() -> None:
    budget = ByteBudget(None)
    assert budget.try_acquire(1 << 50) and budget.used == 1 << 50 and budget.available is None
    budget.release(1 << 50)
    assert budget.used == 0 and budget.peak == 1 << 50


def test_acquired_total_counts_every_charge_and_never_falls() -> None:
    """What tells the idle memory trimmer that requests came (encode_server.app.give_back_memory)."""
    budget = ByteBudget(100)
    budget.acquire(60)
    assert not budget.try_acquire(41)  # refused: not counted
    budget.release(60)
    with budget.charged(30):
        pass
    assert budget.used == 0 and budget.acquired_total == 90
    budget.check_invariants()


def test_a_hold_grows_settles_and_releases_once() -> None:
    budget = ByteBudget(100)
    hold = budget.hold()
    assert hold.grow(30) and hold.grow(20) and hold.held == 50 == budget.used
    assert not hold.grow(51) and hold.held == 50
    assert hold.settle(10) and budget.used == 10  # a step freed copies
    assert not hold.settle(101) and hold.held == 10  # refused growth changes nothing
    assert hold.settle(90) and budget.used == 90
    hold.release()
    hold.release()
    assert budget.used == 0 and hold.closed
    assert not hold.grow(1), "a closed hold must not take bytes it would never give back"
    budget.check_invariants()


def test_a_transient_charge_is_given_back_after_the_block_even_on_error() -> None:
    budget = ByteBudget(100)
    hold = budget.hold()
    hold.grow(50)
    with pytest.raises(RuntimeError), hold.transient(40):
        assert budget.used == 90
        raise RuntimeError
    assert budget.used == 50
    with pytest.raises(OverBudget), hold.transient(51):
        pass
    assert budget.used == 50
    with budget.charged(50):
        assert budget.available == 0
    assert budget.used == 50


def test_a_hold_released_inside_a_transient_block_stays_released() -> None:
    budget = ByteBudget(100)
    hold = budget.hold()
    with hold.transient(40):
        hold.release()
    assert budget.used == 0 and hold.held == 0


def test_concurrent_charges_from_threads_never_overdraw() -> None:
    budget = ByteBudget(1000)
    seen: list[int] = []

    def worker() -> None:
        for _ in range(2000):
            if budget.try_acquire(7):
                seen.append(budget.used)
                budget.release(7)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.used == 0 and max(seen) <= 1000 and budget.peak <= 1000


class BudgetMachine(RuleBasedStateMachine):
    """Random holds growing, settling, shrinking, transient and released, against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = ByteBudget(1000)
        self.holds: list = []
        self.model: list[int] = []  # bytes each open hold should have

    @rule(size=st.integers(0, 600))
    def open_and_grow(self, size: int) -> None:
        hold = self.budget.hold()
        fits = sum(self.model) + size <= 1000
        assert hold.grow(size) == fits
        self.holds.append(hold)
        self.model.append(size if fits else 0)

    @rule(i=st.integers(0, 20), size=st.integers(0, 600))
    def settle(self, i: int, size: int) -> None:
        if not self.holds:
            return
        i %= len(self.holds)
        fits = sum(self.model) - self.model[i] + size <= 1000
        assert self.holds[i].settle(size) == fits
        if fits:
            self.model[i] = size

    @rule(i=st.integers(0, 20))
    def release(self, i: int) -> None:
        if not self.holds:
            return
        i %= len(self.holds)
        self.holds.pop(i).release()
        self.model.pop(i)

    @rule(size=st.integers(0, 1200))
    def raw(self, size: int) -> None:
        if self.budget.try_acquire(size):
            assert sum(self.model) + size <= 1000
            self.budget.release(size)
        else:
            assert sum(self.model) + size > 1000

    @invariant()
    def matches_model(self) -> None:
        self.budget.check_invariants()
        assert self.budget.used == sum(self.model)
        assert [h.held for h in self.holds] == self.model


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_hold_released_while_another_thread_charges_it_never_leaks() -> None:
    budget = ByteBudget(10_000)
    for _ in range(200):
        hold = budget.hold()
        start = threading.Barrier(2)

        def charge(h=hold, b=start) -> None:  # type: ignore[no-untyped-def]
            b.wait()
            for _ in range(50):
                h.grow(3)

        worker = threading.Thread(target=charge)
        worker.start()
        start.wait()
        hold.release()
        worker.join()
        hold.release()
        assert budget.used == 0 and hold.held == 0
