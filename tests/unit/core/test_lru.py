"""ByteLRU: the byte budget, pinning and LRU order hold after every operation."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from encode_server.core.lru import ByteLRU


def _filled(capacity: int, items: dict[str, int]) -> ByteLRU[str, str]:
    lru: ByteLRU[str, str] = ByteLRU(capacity)
    for key, size in items.items():
        assert lru.put(key, f"v-{key}", size)
    lru.check_invariants()
    return lru


# -- reads and recency -----------------------------------------------------------------------------


def test_get_peek_contains_len_on_hits_and_misses() -> None:
    lru = _filled(100, {"a": 10, "b": 20})
    assert lru.get("a") == "v-a" and lru.peek("b") == "v-b"
    assert lru.get("zz") is None and lru.peek("zz") is None
    assert "a" in lru and "zz" not in lru
    assert len(lru) == 2 and lru.used_bytes == 30 and lru.capacity_bytes == 100


def test_eviction_follows_least_recently_used_order() -> None:
    lru = _filled(30, {"a": 10, "b": 10, "c": 10})
    assert lru.put("d", "v-d", 10)
    assert lru.keys() == ["b", "c", "d"]
    assert lru.put("e", "v-e", 20)
    assert lru.keys() == ["d", "e"]
    assert lru.evictions == 3


def test_get_refreshes_recency_but_peek_does_not() -> None:
    lru = _filled(30, {"a": 10, "b": 10, "c": 10})
    lru.get("a")
    lru.peek("b")
    assert lru.keys() == ["b", "c", "a"]
    assert lru.put("d", "v-d", 10)
    assert "b" not in lru and "a" in lru


def test_eviction_stops_once_there_is_room() -> None:
    lru = _filled(100, {"a": 30, "b": 30, "c": 30})
    assert lru.put("d", "v-d", 20)
    assert lru.keys() == ["b", "c", "d"] and lru.used_bytes == 80


# -- put semantics ---------------------------------------------------------------------------------


def test_put_of_an_existing_key_does_not_double_count() -> None:
    lru = _filled(100, {"a": 40, "b": 40})
    assert lru.put("a", "other", 40)
    assert lru.used_bytes == 80 and len(lru) == 2
    assert lru.keys() == ["b", "a"]  # refreshed
    assert lru.peek("a") == "v-a"  # content-addressed: the stored value is kept
    lru.check_invariants()


def test_put_of_an_existing_key_with_another_size_keeps_the_accounting() -> None:
    lru = _filled(100, {"a": 40})
    assert lru.put("a", "v-a", 90)
    assert lru.used_bytes == 40
    lru.check_invariants()


def test_oversize_item_is_refused_without_evicting_anything() -> None:
    evicted: list[tuple[str, int]] = []
    lru: ByteLRU[str, str] = ByteLRU(100, on_evict=lambda k, s: evicted.append((k, s)))
    for key in "abc":
        lru.put(key, key, 30)
    assert not lru.can_fit(101)
    assert not lru.put("huge", "x", 101)
    assert lru.keys() == ["a", "b", "c"] and lru.used_bytes == 90
    assert evicted == [] and lru.evictions == 0
    assert lru.can_fit(100) and lru.put("whole", "x", 100)
    assert lru.keys() == ["whole"]


def test_capacity_zero_turns_caching_off() -> None:
    lru: ByteLRU[str, str] = ByteLRU(0)
    assert not lru.can_fit(0) and not lru.can_fit(1)
    assert not lru.put("a", "v", 0)
    assert not lru.put("b", "v", 1)
    assert len(lru) == 0 and lru.used_bytes == 0
    lru.check_invariants()


def test_zero_size_items_are_cached() -> None:
    lru = _filled(10, {"a": 10})
    assert lru.put("empty", "v", 0)
    assert lru.keys() == ["a", "empty"]


# -- pinning ---------------------------------------------------------------------------------------


def test_pinned_entries_survive_eviction_pressure() -> None:
    lru = _filled(100, {"a": 40, "b": 30})
    lru.pin("a")
    for i in range(50):
        assert lru.put(f"x{i}", "v", 30)
        assert "a" in lru
        lru.check_invariants()
    assert lru.peek("a") == "v-a" and lru.pinned_bytes == 40


def test_put_that_fits_only_by_evicting_pinned_entries_fails_and_changes_nothing() -> None:
    lru = _filled(100, {"a": 50, "b": 30, "c": 10})
    lru.pin("a")
    assert not lru.can_fit(51)
    assert not lru.put("d", "v", 51)
    assert lru.keys() == ["a", "b", "c"] and lru.evictions == 0
    assert lru.can_fit(50)
    assert lru.put("d", "v", 50)
    assert lru.keys() == ["a", "d"]


def test_unpin_makes_an_entry_evictable_again() -> None:
    lru = _filled(100, {"a": 60})
    lru.pin("a")
    assert not lru.put("b", "v", 60)
    lru.unpin("a")
    assert lru.pinned_bytes == 0
    assert lru.put("b", "v", 60)
    assert "a" not in lru


def test_pins_are_reference_counted() -> None:
    lru = _filled(100, {"a": 60})
    lru.pin("a")
    assert lru.get_and_pin("a") == "v-a"
    assert lru.pin_count("a") == 2 and lru.pinned_bytes == 60
    lru.unpin("a")
    assert not lru.put("b", "v", 60)  # one holder left
    lru.unpin("a")
    assert lru.pin_count("a") == 0 and lru.pinned_bytes == 0
    assert lru.put("b", "v", 60)


def test_pin_counts_never_go_negative() -> None:
    lru = _filled(100, {"a": 10})
    with pytest.raises(ValueError, match="not pinned"):
        lru.unpin("a")
    lru.pin("a")
    lru.unpin("a")
    with pytest.raises(ValueError, match="not pinned"):
        lru.unpin("a")
    assert lru.pin_count("a") == 0
    lru.check_invariants()


def test_pin_and_unpin_of_an_absent_key_are_errors() -> None:
    lru: ByteLRU[str, str] = ByteLRU(100)
    with pytest.raises(KeyError):
        lru.pin("a")
    with pytest.raises(KeyError):
        lru.unpin("a")


def test_get_and_pin_of_a_miss_pins_nothing() -> None:
    lru = _filled(100, {"a": 10})
    assert lru.get_and_pin("b") is None
    assert lru.pinned_bytes == 0


def test_get_and_pin_refreshes_recency() -> None:
    lru = _filled(30, {"a": 10, "b": 10, "c": 10})
    lru.get_and_pin("a")
    lru.unpin("a")
    assert lru.keys() == ["b", "c", "a"]


def test_remove_drops_only_unpinned_entries() -> None:
    lru = _filled(100, {"a": 10, "b": 20})
    lru.pin("a")
    assert not lru.remove("a")
    assert lru.remove("b")
    assert not lru.remove("b")
    assert lru.keys() == ["a"] and lru.used_bytes == 10 and lru.evictions == 0
    lru.check_invariants()


# -- eviction callback and argument checks ---------------------------------------------------------


def test_on_evict_reports_each_evicted_key_and_size_after_the_cache_is_consistent() -> None:
    seen: list[tuple[str, int, bool]] = []
    lru: ByteLRU[str, str]

    def on_evict(key: str, size: int) -> None:
        lru.check_invariants()
        seen.append((key, size, "new" in lru))

    lru = ByteLRU(50, on_evict=on_evict)
    lru.put("a", "v", 20)
    lru.put("b", "v", 20)
    lru.put("new", "v", 40)
    assert seen == [("a", 20, True), ("b", 20, True)]
    assert lru.evictions == 2


@pytest.mark.parametrize("size", [-1, 1.5, True, "3"])
def test_sizes_must_be_non_negative_ints(size: object) -> None:
    lru: ByteLRU[str, str] = ByteLRU(10)
    with pytest.raises(ValueError):
        lru.put("a", "v", size)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        lru.can_fit(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [-1, 1.0, None])
def test_capacity_must_be_a_non_negative_int(capacity: object) -> None:
    with pytest.raises(ValueError):
        ByteLRU(capacity)  # type: ignore[arg-type]


def test_none_cannot_be_cached_since_get_returns_none_for_absent() -> None:
    lru: ByteLRU[str, str | None] = ByteLRU(10)
    with pytest.raises(ValueError):
        lru.put("a", None, 1)


def test_check_invariants_detects_corrupted_accounting() -> None:
    lru = _filled(100, {"a": 10})
    lru._used = 5  # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="used_bytes"):
        lru.check_invariants()


# -- random workloads: a reference model, checked after every operation ----------------------------


class LRUMachine(RuleBasedStateMachine):
    """Drives ByteLRU against a plain OrderedDict model of the intended semantics."""

    keys_ = st.sampled_from([f"k{i}" for i in range(8)])
    # Mostly items that fit a few at a time (eviction pressure), some larger than any capacity.
    sizes = st.integers(0, 35) | st.sampled_from([0, 101, 150])

    @initialize(capacity=st.sampled_from([0, 40, 100]))
    def create(self, capacity: int) -> None:
        self.capacity = capacity
        self.evicted: list[str] = []
        self.lru: ByteLRU[str, str] = ByteLRU(capacity, on_evict=lambda k, s: self.evicted.append(k))
        self.model: OrderedDict[str, list[int]] = OrderedDict()  # key -> [size, pins]; LRU first

    def _model_pinned(self) -> int:
        return sum(size for size, pins in self.model.values() if pins)

    @rule(key=keys_, size=sizes)
    def put(self, key: str, size: int) -> None:
        fits = self.capacity > 0 and self._model_pinned() + size <= self.capacity
        assert self.lru.can_fit(size) == fits
        pinned_before = {k for k, (_, pins) in self.model.items() if pins}
        self.evicted.clear()
        if key in self.model:
            self.model.move_to_end(key)
        elif fits:
            used = sum(s for s, _ in self.model.values())
            for old in list(self.model):
                if used + size <= self.capacity:
                    break
                if not self.model[old][1]:
                    used -= self.model.pop(old)[0]
            self.model[key] = [size, 0]
        assert self.lru.put(key, f"v-{key}", size) == (key in self.model)
        assert not set(self.evicted) & pinned_before, "a pinned entry was evicted"
        assert self.lru.evictions >= len(self.evicted)

    @rule(key=keys_, size=sizes)
    def put_more(self, key: str, size: int) -> None:  # a second rule: puts drive the interesting states
        self.put(key, size)

    @rule(key=keys_)
    def get(self, key: str) -> None:
        value = self.lru.get(key)
        assert (value is not None) == (key in self.model)
        if key in self.model:
            assert value == f"v-{key}"
            self.model.move_to_end(key)

    @rule(key=keys_)
    def peek(self, key: str) -> None:
        assert (self.lru.peek(key) is not None) == (key in self.model)

    @rule(key=keys_)
    def get_and_pin(self, key: str) -> None:
        value = self.lru.get_and_pin(key)
        assert (value is not None) == (key in self.model)
        if key in self.model:
            self.model.move_to_end(key)
            self.model[key][1] += 1

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.lru.pin(key)
        self.model[key][1] += 1

    @precondition(lambda self: any(pins for _, pins in self.model.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, (_, pins) in self.model.items() if pins)))
        self.lru.unpin(key)
        self.model[key][1] -= 1

    @rule(key=keys_)
    def unpin_unpinned_is_refused(self, key: str) -> None:
        if key in self.model and self.model[key][1] == 0:
            with pytest.raises(ValueError):
                self.lru.unpin(key)

    @rule(key=keys_)
    def remove(self, key: str) -> None:
        removable = key in self.model and self.model[key][1] == 0
        assert self.lru.remove(key) == removable
        if removable:
            del self.model[key]

    @invariant()
    def matches_model_and_holds_invariants(self) -> None:
        self.lru.check_invariants()
        assert self.lru.keys() == list(self.model)
        assert self.lru.used_bytes == sum(s for s, _ in self.model.values()) <= self.capacity
        assert self.lru.pinned_bytes == self._model_pinned()
        for key, (_, pins) in self.model.items():
            assert self.lru.pin_count(key) == pins >= 0


LRUMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_lru_matches_reference_model_under_random_workloads = LRUMachine.TestCase


def test_random_request_workload_keeps_the_byte_budget() -> None:
    """Requests pin what they use, then release it; the budget and pins hold throughout."""
    rng = random.Random(7)
    lru: ByteLRU[int, int] = ByteLRU(10_000)
    in_flight: list[list[int]] = []
    for _ in range(5_000):
        if in_flight and rng.random() < 0.45:
            for key in in_flight.pop(rng.randrange(len(in_flight))):
                lru.unpin(key)
        else:
            held = []
            for key in rng.sample(range(200), rng.randint(1, 4)):
                if lru.get_and_pin(key) is not None:
                    held.append(key)
                elif lru.put(key, key, rng.choice([0, 100, 1_500, 4_000, 12_000])):
                    lru.pin(key)
                    held.append(key)
            in_flight.append(held)
        lru.check_invariants()
        assert lru.used_bytes <= lru.capacity_bytes
        for held in in_flight:
            assert all(key in lru for key in held)
    for held in in_flight:
        for key in held:
            lru.unpin(key)
    assert lru.pinned_bytes == 0
