"""heap.py: the startup heap frozen out of the collector, and the collector's pauses timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from encode_server.heap import GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Nothing frozen before the test, and nothing after it: the freeze is process-wide."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_objects_alive_are_frozen_and_a_full_collection_no_longer_walks_them(unfrozen: None) -> None:
    kept = [[i] for i in range(10_000)]  # tracked containers, alive
    frozen = freeze_startup_heap()
    # Not equal to a later count: a frozen object whose last reference goes is still freed (a
    # frame's temporaries, another thread's), and leaves the permanent generation.
    assert frozen >= len(kept) and gc.get_freeze_count() >= len(kept)
    tracked = gc.get_objects()  # what a full collection walks
    assert not any(x is kept[0] or x is kept[-1] for x in tracked)
    made_after = [0]
    assert any(x is made_after for x in gc.get_objects()), "what serving makes is still collected"


def test_garbage_left_before_the_freeze_is_collected_not_frozen(unfrozen: None) -> None:
    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    del a, b  # unreachable, but alive until a collection
    freeze_startup_heap()
    assert not any(isinstance(x, Cycle) for x in gc.get_objects())
    gc.unfreeze()
    assert not any(isinstance(x, Cycle) for x in gc.get_objects()), "collected, not frozen"


def test_every_collection_is_timed_by_generation_while_installed() -> None:
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(lambda generation, seconds: seen.append((generation, seconds)))
    pauses.install()
    pauses.install()  # once only
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.remove()
    assert [g for g, _ in seen] == [0, 2]
    assert all(0 <= s < 10 for _, s in seen)
    gc.collect(1)
    assert len(seen) == 2, "removed: no more calls"
