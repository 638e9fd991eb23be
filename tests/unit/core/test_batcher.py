"""The batcher's invariants, with a plain Python function standing in for the forward pass."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from encode_server.core.batcher import Batcher, BatchStats
from encode_server.core.errors import Unavailable


class Recorder:
    """A forward pass that doubles its inputs and records every batch it was given."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay = delay
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()  # set once a forward pass has started

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.entered.set()
        self.release.wait(10)
        time.sleep(self.delay)
        self.batches.append(list(items))
        return [2 * x for x in items]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 20))


async def in_forward_pass(rec: Recorder) -> None:
    """Until a batch is inside the forward pass (an event, not a guess at how long that takes)."""
    assert await asyncio.to_thread(rec.entered.wait, 10), "no forward pass started"


def test_items_from_many_submitters_share_a_batch() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=0.05)
        b.start()
        results = await asyncio.gather(*(b.submit(i, 1) for i in range(32)))
        assert results == [2 * i for i in range(32)]
        await b.close()
        return rec

    rec = run(main())
    assert len(rec.batches) < 4
    assert sorted(x for batch in rec.batches for x in batch) == list(range(32))


def test_batch_respects_size_and_token_budgets_and_fifo_order() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        rec.release.clear()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=4, max_batch_tokens=10, max_wait_s=0.01)
        b.start()
        costs = [3, 3, 3, 3, 1, 1, 1, 1, 1, 20, 2]
        futures = [b.submit(i, c) for i, c in enumerate(costs)]
        rec.release.set()
        await asyncio.gather(*futures)
        await b.close()
        return rec

    rec = run(main())
    costs = [3, 3, 3, 3, 1, 1, 1, 1, 1, 20, 2]
    for batch in rec.batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or sum(costs[i] for i in batch) <= 10
    flat = [x for batch in rec.batches for x in batch]
    assert flat == sorted(flat), "items were reordered"
    assert [9] in rec.batches, "an item above the token budget must run alone, not starve"


def test_lone_item_on_an_idle_model_runs_at_once_not_after_the_window() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        # A window of an hour: only a batcher that waits for a lone item could miss the 20 s limit.
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=3600)
        b.start()
        assert await b.submit(1, 1) == 2
        assert await b.submit(2, 1) == 4
        await b.close()
        return rec

    assert run(main()).batches == [[1], [2]]


def test_items_arriving_during_a_forward_pass_form_the_next_batch() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        rec.release.clear()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=3600)
        b.start()
        first = b.submit(0, 1)
        await asyncio.sleep(0.05)  # item 0 is in the (blocked) forward pass
        rest = [b.submit(i, 1) for i in range(1, 6)]
        rec.release.set()
        assert await asyncio.gather(first, *rest) == [0, 2, 4, 6, 8, 10]
        await b.close()
        return rec

    assert run(main()).batches == [[0], [1, 2, 3, 4, 5]]


def test_idle_model_waits_for_items_announced_as_arriving() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=3600)
        b.start()

        async def decode_then_submit(i: int) -> int:
            with b.arriving():
                await asyncio.sleep(0.01 * i)  # "decoding" takes longer for each
            return await b.submit(i, 1)

        assert await asyncio.gather(*(decode_then_submit(i) for i in range(4))) == [0, 2, 4, 6]
        await b.close()
        return rec

    assert run(main()).batches == [[0, 1, 2, 3]]


def test_wait_for_announced_items_is_capped_by_max_wait() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=0.02)
        b.start()
        never = asyncio.Event()

        async def announced_forever() -> None:
            with b.arriving():
                await never.wait()

        stuck = asyncio.create_task(announced_forever())
        await asyncio.sleep(0)
        assert await b.submit(7, 1) == 14  # the announced item never comes: this one runs anyway
        stuck.cancel()
        await b.close()
        return rec

    assert run(main()).batches == [[7]]


def test_an_announced_item_that_fails_to_decode_does_not_hold_the_batch() -> None:
    async def main() -> Recorder:
        rec = Recorder()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=3600)
        b.start()

        async def bad_image() -> None:
            with b.arriving():
                await asyncio.sleep(0.02)
                raise ValueError("not an image")

        failing = asyncio.create_task(bad_image())
        await asyncio.sleep(0)
        result = await b.submit(3, 1)  # waits for the announced item, which then gives up
        assert result == 6
        with pytest.raises(ValueError):
            await failing
        await b.close()
        return rec

    assert run(main()).batches == [[3]]


def test_the_batcher_refuses_nothing_its_callers_admitted() -> None:
    # --max-queue is counted once, in items, by the service (admission.QueueBound): a video's many
    # parts, all submitted behind a blocked pass, are queued, never refused halfway.
    async def main() -> None:
        rec = Recorder()
        rec.release.clear()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=1, max_batch_tokens=10, max_wait_s=0)
        b.start()
        first = b.submit(0, 1)
        await in_forward_pass(rec)  # the first item is in the (blocked) forward pass
        queued = [b.submit(i, 1) for i in range(1, 300)]
        assert (b.pending, b.passes_running) == (299, 1)
        rec.release.set()
        assert await asyncio.gather(first, *queued) == [2 * i for i in range(300)]
        await b.close()

    run(main())


def test_forward_failure_fails_only_that_batch() -> None:
    def flaky(items: Sequence[int]) -> list[int]:
        if 13 in items:
            raise RuntimeError("boom")
        return list(items)

    async def main() -> None:
        b: Batcher[int, int] = Batcher(flaky, max_batch_size=1, max_batch_tokens=10, max_wait_s=0)
        b.start()
        bad = b.submit(13, 1)
        good = b.submit(7, 1)
        with pytest.raises(RuntimeError, match="boom"):
            await bad
        assert await good == 7
        await b.close()

    run(main())


def test_cancelled_items_are_not_run_and_observer_sees_each_batch() -> None:
    stats: list[BatchStats] = []

    async def main() -> Recorder:
        rec = Recorder()
        rec.release.clear()
        b: Batcher[int, int] = Batcher(
            rec, max_batch_size=8, max_batch_tokens=100, max_wait_s=0.05, observer=stats.append
        )
        b.start()
        blocker = b.submit(0, 1)
        await in_forward_pass(rec)
        doomed = b.submit(1, 1)
        kept = b.submit(2, 5)
        doomed.cancel()
        rec.release.set()
        await asyncio.gather(blocker, kept)
        await b.close()
        return rec

    rec = run(main())
    assert [1] not in rec.batches and all(1 not in batch for batch in rec.batches)
    assert [s.size for s in stats] == [len(batch) for batch in rec.batches]
    assert stats[-1].tokens == 5


def test_close_fails_queued_items_with_not_ready() -> None:
    async def main() -> None:
        rec = Recorder()
        rec.release.clear()
        b: Batcher[int, int] = Batcher(rec, max_batch_size=1, max_batch_tokens=10, max_wait_s=0)
        b.start()
        b.submit(0, 1)
        await in_forward_pass(rec)
        queued = b.submit(1, 1)
        await b.close()
        rec.release.set()
        with pytest.raises(Unavailable) as info:
            await queued
        assert info.value.type == "not_ready"

    run(main())


def test_an_exception_result_fails_its_item_alone() -> None:
    """A forward pass that finds one item bad (an image that decodes only in its batch) returns its
    error in that item's place: that requester gets the error, the others their results."""

    def forward(items: Sequence[int]) -> list[int | BaseException]:
        return [Unavailable(f"bad {x}", type="overloaded") if x < 0 else 2 * x for x in items]

    async def scenario() -> list[object]:
        batcher: Batcher[int, int] = Batcher(forward, max_batch_size=8, max_batch_tokens=100, max_wait_s=0.05)
        batcher.start()
        try:
            futures = [batcher.submit(x, 1) for x in (1, -2, 3)]
            return list(await asyncio.gather(*futures, return_exceptions=True))
        finally:
            await batcher.close()

    first, bad, last = run(scenario())
    assert (first, last) == (2, 6)
    assert isinstance(bad, Unavailable) and str(bad) == "bad -2"


class Overlap(Recorder):
    """A forward pass that records how many passes ran at once, at most."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.running = self.most = 0
        self.two_in = threading.Event()  # set once two passes are inside at the same time

    def __call__(self, items: Sequence[int]) -> list[int]:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            if self.running >= 2:
                self.two_in.set()
        try:
            return super().__call__(items)
        finally:
            with self._lock:
                self.running -= 1


def two_passes(rec: Recorder) -> Batcher[int, int]:
    """A started batcher that runs up to two passes of ``rec`` at once."""
    b: Batcher[int, int] = Batcher(rec, max_batch_size=64, max_batch_tokens=10**6, max_wait_s=0,
                                   concurrency=2)
    b.start()
    return b


def test_concurrent_passes_run_side_by_side_up_to_the_limit() -> None:
    async def main() -> Overlap:
        rec = Overlap()
        rec.release.clear()
        b = two_passes(rec)
        first = b.submit(0, 1)
        await in_forward_pass(rec)
        second = b.submit(1, 1)  # the other pass is free: it runs now, not after the first
        assert await asyncio.to_thread(rec.two_in.wait, 10), "the second pass did not start beside the first"
        rest = [b.submit(i, 1) for i in range(2, 6)]  # both passes busy: these wait, then go two by two
        await asyncio.sleep(0.05)
        assert rec.running == 2
        rec.release.set()
        assert await asyncio.gather(first, second, *rest) == [0, 2, 4, 6, 8, 10]
        await b.close()
        return rec

    rec = run(main())
    assert rec.most == 2
    # the first two ran alone, side by side (recorded in whatever order the passes ended)
    assert [0] in rec.batches and [1] in rec.batches and len(rec.batches) >= 4
    rest = [batch for batch in rec.batches if batch not in ([0], [1])]
    assert sorted(x for batch in rest for x in batch) == [2, 3, 4, 5]
    assert all(len(batch) <= 2 for batch in rest)  # the first pass free took its share, not all four


def test_free_passes_share_the_queue() -> None:
    async def main() -> Overlap:
        rec = Overlap()
        b = two_passes(rec)
        # Queued in one go while both passes are free: half each, not all eight in the first.
        assert await asyncio.gather(*(b.submit(i, 1) for i in range(8))) == [2 * i for i in range(8)]
        await b.close()
        return rec

    rec = run(main())
    assert sorted(rec.batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_close_fails_the_items_of_running_passes_with_not_ready() -> None:
    async def main() -> None:
        rec = Overlap()
        rec.release.clear()
        b = two_passes(rec)
        running = b.submit(0, 1)
        await in_forward_pass(rec)
        await b.close()
        with pytest.raises(Unavailable) as info:
            await running
        assert info.value.type == "not_ready"
        rec.release.set()  # the executor's call ends on its own

    run(main())
