"""Dynamic batching across requests, bounded by images, tokens and time.

Items from any number of requests queue here; one loop forms a batch from the head of the
queue and runs it in an executor (the forward pass never blocks the event loop). Up to
``concurrency`` batches run at once, as Triton runs several instances of a model: on a CPU, two
single-threaded passes side by side keep two cores busier than one pass split over both (a small
tower's many small operators leave a split pass's second thread idle; ``encoders/threads.py``).

Batching as infinity does it: the window is a cap, not a toll. A lone item on an idle model
runs at once; items that arrive while a forward pass runs queue up, and the next batch takes
them all the moment that pass ends. Waiting to fill a batch only happens while callers have
announced items on their way (``with batcher.arriving():`` around decoding an image), and then
for at most ``max_wait_s``.

Invariants:
- A batch holds at most ``max_batch_size`` items and at most ``max_batch_tokens`` cost tokens,
  except that an item costing more than ``max_batch_tokens`` alone runs alone (never starved).
- At most ``concurrency`` batches run at once. When a pass is free, a batch starts at once, unless
  it is not full and items are announced as arriving; then it starts when it is full, when no
  announced item is left, or when its oldest item has waited ``max_wait_s`` (monotonic, from that
  item's arrival, as LitServe's loop does).
- Passes share the queue: the free passes start at once, each taking at most ``ceil(q /
  concurrency)`` of the ``q`` items queued, so work is spread over the passes rather than one
  taking all while the next to be free idles.
- The queue is not bounded here: what is submitted was admitted by its caller (the service's
  ``--max-queue``, in items: ``admission.QueueBound``). A bound of its own would be a second count
  in another unit, parts: it refused a long video's later parts after queuing its first ones.
- Items whose future was cancelled before their batch formed are dropped, not run.
- Order is FIFO: no item starts its pass after a later one's started (with ``concurrency`` > 1, a
  later batch may finish first).
- ``run_batch`` returns one result per item; a result that is an exception fails its item
  alone (an image found bad only when its batch decodes it), an exception raised fails them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from encode_server.core.errors import Unavailable

__all__ = ["BatchObserver", "BatchStats", "Batcher"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class BatchStats:
    size: int
    tokens: int
    queue_waits: tuple[float, ...]  # seconds each item waited before its batch started
    forward_seconds: float


class BatchObserver(Protocol):
    def __call__(self, stats: BatchStats) -> None: ...


@dataclass
class _Pending(Generic[T, R]):
    item: T
    cost: int
    future: asyncio.Future[R]
    enqueued_at: float = field(default_factory=time.monotonic)


class Batcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R | BaseException]],
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_s: float,
        executor: Executor | None = None,
        observer: BatchObserver | None = None,
        concurrency: int = 1,
    ) -> None:
        assert max_batch_size > 0 and max_batch_tokens > 0 and max_wait_s >= 0 and concurrency > 0
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self._executor = executor
        self._observer = observer
        self.concurrency = concurrency  # the executor must run this many calls at once
        self._running: set[asyncio.Task[None]] = set()
        self._arriving = 0
        self._queue: deque[_Pending[T, R]] = deque()
        self._queued_cost = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.batches_run = 0

    @property
    def pending(self) -> int:
        """Items queued and not yet in a batch."""
        return len(self._queue)

    @property
    def passes_running(self) -> int:
        """Forward passes under way."""
        return len(self._running)

    def submit(self, item: T, cost: int) -> asyncio.Future[R]:
        """Queue ``item`` (already admitted: nothing is refused here); the future resolves to its
        result. Call from the event loop."""
        if self._task is None:
            raise RuntimeError("Batcher.start() was not called")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(item, max(1, cost), future))
        self._queued_cost += max(1, cost)
        self._wakeup.set()
        return future

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def close(self) -> None:
        """Stop the loop; items still queued fail with ``Unavailable("not_ready")``."""
        if self._task is not None:
            task, self._task = self._task, None
            # Python 3.11's wait_for can swallow a cancel that lands as its inner wait completes
            # (the loop then waits for a wakeup that never comes, and close() hung): cancel until
            # the task is really done.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in list(self._running):  # their items fail as queued ones do; the executor's call
            task.cancel()  # itself runs to its end, unawaited
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        while self._queue:
            p = self._queue.popleft()
            if not p.future.done():
                p.future.set_exception(Unavailable("server is shutting down", type="not_ready"))
        self._queued_cost = 0

    def _full(self) -> bool:
        return len(self._queue) >= self.max_batch_size or self._queued_cost >= self.max_batch_tokens

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Announce one item on its way (an image being decoded): an idle model waits for it, up
        to ``max_wait_s``, rather than start a batch without it. Submit right after the block."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            self._wakeup.set()

    def _more_arriving(self) -> bool:
        return self._arriving > 0

    async def _loop(self) -> None:
        while True:
            if not self._queue or len(self._running) >= self.concurrency:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # A free pass: go now, unless more items are known to be on their way (then wait for
            # them, at most until the oldest item has waited max_wait_s). Items that came while
            # the other passes ran are all here already: no wait for them.
            deadline = self._queue[0].enqueued_at + self.max_wait_s
            while not self._full() and self._more_arriving():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            share = -(-len(self._queue) // self.concurrency)
            for _ in range(self.concurrency - len(self._running)):
                batch = self._take(share)
                if not batch:
                    break
                task = asyncio.get_running_loop().create_task(self._run(batch), name="forward-pass")
                self._running.add(task)
                task.add_done_callback(self._pass_done)
            batch = []  # not held while idle: the items' inputs (pixels) would outlive their batch

    def _pass_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wakeup.set()

    def _take(self, most: int) -> list[_Pending[T, R]]:
        batch: list[_Pending[T, R]] = []
        tokens = 0
        while self._queue and len(batch) < min(most, self.max_batch_size):
            head = self._queue[0]
            if head.future.done():  # cancelled while queued
                self._queue.popleft()
                self._queued_cost -= head.cost
                continue
            if batch and tokens + head.cost > self.max_batch_tokens:
                break
            self._queue.popleft()
            self._queued_cost -= head.cost
            batch.append(head)
            tokens += head.cost
        return batch

    async def _run(self, batch: list[_Pending[T, R]]) -> None:
        started = time.monotonic()
        waits = tuple(started - p.enqueued_at for p in batch)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, [p.item for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} returned {len(results)} results")
        except asyncio.CancelledError:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(Unavailable("server is shutting down", type="not_ready"))
            raise
        except Exception as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self.batches_run += 1
        forward_seconds = time.monotonic() - started
        for p, result in zip(batch, results, strict=True):
            if p.future.done():
                continue
            if isinstance(result, BaseException):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)
        if self._observer is not None:
            self._observer(
                BatchStats(len(batch), sum(p.cost for p in batch), waits, forward_seconds)
            )
