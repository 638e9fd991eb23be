"""The shared tier on Redis or Redis Cluster; the only module that imports ``redis``.

Redis is an accelerator, never a dependency (docs/cache.md):
- every call has a short connect/socket timeout and an overall deadline, and goes through one
  :class:`CircuitBreaker`; while it is open, reads answer "miss" at once and writes are skipped;
- redis-py's own retries are off: a retry would only multiply the time a request waits on a dead
  Redis, and the breaker plus a background probe (PING, at the breaker's backoff) already bring
  the tier back by itself when Redis answers again;
- reads are one pipelined multi-key read per request (MGET; ``mget_nonatomic`` on a cluster, which
  groups keys by slot and pipelines one round trip per node);
- writes go behind the response through a bounded queue drained by one task that pipelines them;
  a full queue drops the write and counts it, it never blocks a response;
- writes that could not happen because Redis was unavailable (breaker open, or the write failed)
  are kept in a replay buffer bounded in bytes (``--redis-replay-mb``, oldest dropped first, each
  counted) and written once the breaker closes again: an image first encoded during an outage
  still reaches the other replicas afterwards, instead of being encoded again by each of them.

A stored value that fails :func:`decode_value` is a miss counted as
``cache_lookups_total{tier="redis",result="corrupt"}``, never served; the re-encode overwrites it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar, get_args

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from encode_server.config import Settings
from encode_server.core.breaker import BreakerState, CircuitBreaker
from encode_server.core.errors import TooLarge, Unavailable
from encode_server.core.hashing import CacheKey
from encode_server.core.stored import CorruptValue, ValueSpec, decode_value, encode_value
from encode_server.core.types import Embedding
from encode_server.metrics import Metrics

__all__ = [
    "RedisTier", "TierRefused", "TierUnavailable", "check_url", "create_redis_tier", "is_cluster_url", "redact_url",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
# One pipelined write carries at most this many values / bytes, so that it fits in its deadline.
_WRITE_BATCH_ITEMS = 32
_WRITE_BATCH_BYTES = 8 << 20
# A call that moves many bytes gets this much extra time per byte (a slow 100 MB/s link), so a
# large hand-off is not mistaken for an outage and does not open the breaker for everyone.
_SECONDS_PER_BYTE = 1 / (100 << 20)
# The write-behind queue holds embeddings in memory: bound its bytes as well as its count.
_WRITE_QUEUE_BYTES = 256 << 20
# Faults that mean "Redis is not answering": they count against the breaker. A ResponseError means
# Redis answered (OOM under noeviction, a wrong type): counted as an error, not as an outage.
RedisOp = Literal["get", "exists", "set", "ping"]  # the redis_errors_total{op} values
_OPS: tuple[RedisOp, ...] = get_args(RedisOp)
_OUTAGES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class TierUnavailable(Exception):
    """The call did not happen or did not complete: breaker open, timeout, connection error."""


class TierRefused(TierUnavailable):
    """Redis answered with an error (OOM under noeviction, a wrong type): up, but it said no."""


def is_cluster_url(url: str) -> bool:
    return url.startswith(tuple(_CLUSTER_SCHEMES))


def redact_url(url: str) -> str:
    """The URL without its credentials (``user:pass@`` or ``?password=``), for logs."""
    scheme, sep, rest = url.partition("://")
    _creds, at, host = rest.rpartition("@")
    host, q, query = host.partition("?")
    if q:
        query = re.sub(r"(?i)(^|&)(password|username)=[^&]*", r"\1\2=***", query)
    return f"{scheme}{sep}{'***@' if at else ''}{host}{q}{query}" if sep else url


def _plain_url(url: str) -> str:
    """A ``+cluster`` URL as redis-py reads it (its cluster client takes redis:// and rediss://)."""
    for scheme, plain in _CLUSTER_SCHEMES.items():
        if url.startswith(scheme):
            return plain + url[len(scheme) :]
    return url


def check_url(url: str) -> None:
    """``ValueError`` for a URL redis-py would refuse (a scheme, a query option such as
    ``?socket_timeout=abc``), said without the URL itself: it may hold a password. Cheap, so the
    server checks it before it opens a port."""
    parse_url(_plain_url(url))


def create_redis_tier(settings: Settings, metrics: Metrics, spec: ValueSpec) -> RedisTier:
    """The tier for ``--redis-url`` (callers check it is set). The client connects lazily, so a
    server starts, and is ready, whether or not Redis is up."""
    assert settings.redis_url is not None
    url = settings.redis_url
    timeout = settings.redis_timeout_ms / 1000.0
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    client: Redis | RedisCluster
    if settings.redis_cluster or is_cluster_url(url):
        client = RedisCluster.from_url(_plain_url(url), **options)
    else:
        client = Redis.from_url(url, **options)
    return RedisTier(
        client,
        spec,
        metrics,
        ttl=settings.redis_ttl,
        timeout=timeout,
        max_value_bytes=settings.redis_max_value_bytes,
        write_queue=settings.redis_write_queue,
        replay_bytes=settings.redis_replay_bytes,
    )


class RedisTier:
    """``SharedTier`` on a redis-py asyncio client (single node or cluster). Event-loop only."""

    name = "redis"

    def __init__(
        self,
        client: Redis | RedisCluster,
        spec: ValueSpec,
        metrics: Metrics,
        *,
        ttl: int,
        timeout: float,
        max_value_bytes: int,
        write_queue: int,
        breaker: CircuitBreaker | None = None,
        probe_interval: float = 2.0,
        replay_bytes: int = 0,
    ) -> None:
        self._client = client
        self._spec = spec
        self._ttl = ttl or None
        # A call may need a connect and a read (on a cluster, also a topology refresh): the
        # socket timeouts bound each step, this deadline bounds the whole call.
        self._deadline = 3 * timeout
        self._max_value_bytes = max_value_bytes
        self._breaker = breaker or CircuitBreaker(failure_threshold=3, probe_timeout=max(1.0, 2 * self._deadline))
        self._probe_interval = probe_interval
        self._queue: asyncio.Queue[tuple[CacheKey, Embedding]] = asyncio.Queue(maxsize=write_queue)
        self._queued_bytes = 0
        # Writes waiting in the queue, per key; and how many of those a hand-off has made since
        # (the queue is FIFO: they are the oldest ones), which are skipped, not sent a second time.
        self._queued_keys: Counter[CacheKey] = Counter()
        self._superseded: Counter[CacheKey] = Counter()
        self._max_queued_bytes = max(_WRITE_QUEUE_BYTES, max_value_bytes)
        self._tasks: list[asyncio.Task[None]] = []
        # Writes Redis missed while unavailable, oldest first; replayed when the breaker closes.
        self._replay: OrderedDict[CacheKey, Embedding] = OrderedDict()
        self._replay_bytes = 0
        self._max_replay_bytes = replay_bytes
        self._replay_task: asyncio.Task[None] | None = None
        self._replay_gauge = metrics.redis_replay_bytes
        self._replay_gauge.set(0)
        self._up = metrics.redis_up
        self._errors = metrics.redis_errors
        for op in _OPS:  # at 0 from the start, so "no data" never stands for "no errors"
            self._errors.labels(op=op)
        self._lookups = {
            result: metrics.cache_lookups.labels(tier=self.name, result=result)
            for result in ("hit", "miss", "corrupt", "unavailable")
        }
        self._writes = {
            result: metrics.redis_writes.labels(result=result)
            for result in (
                "written", "queue_full", "too_large", "breaker_open", "error", "deferred", "replayed",
                "replay_dropped", "superseded",
            )
        }
        self._up.set(0)

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._drain_writes()), asyncio.create_task(self._probe())]

    async def check_reachable(self) -> str | None:
        """One PING at start, before the server says what its shared tier is: None when Redis
        answered, else why not. Unreachable, the breaker opens at once (``trip``): requests use
        the local tier without waiting on Redis, and the probe brings the tier back, logged,
        when it answers."""
        try:
            await asyncio.wait_for(self._client.ping(), self._deadline)
        except ResponseError:  # it answered (an ACL without PING, say): up, as ``_call`` counts it
            self._errors.labels(op="ping").inc()
        except _OUTAGES as exc:
            self._errors.labels(op="ping").inc()
            self._breaker.trip()
            self._up.set(0)
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._up.set(1)
        return None

    async def close(self) -> None:
        """Stop the writer and the probe; writes still queued are dropped (Redis is a cache)."""
        tasks = [*self._tasks, *([self._replay_task] if self._replay_task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    # -- reads ---------------------------------------------------------------------------------

    async def get_many(self, keys: Sequence[CacheKey]) -> list[Embedding | None]:
        if not keys:
            return []
        try:
            blobs = await self._call("get", lambda: self._mget(keys))
        except TierUnavailable:
            self._lookups["unavailable"].inc(len(keys))
            return [None] * len(keys)
        out: list[Embedding | None] = []
        for key, blob in zip(keys, blobs, strict=True):
            value = None
            if blob is None:
                self._lookups["miss"].inc()
            else:
                try:
                    value = decode_value(blob, self._spec, key.mm_hash)
                    self._lookups["hit"].inc()
                except CorruptValue as exc:
                    self._lookups["corrupt"].inc()
                    log.warning("corrupt value under %s is a miss (it will be overwritten): %s", key, exc)
            out.append(value)
        return out

    async def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Presence only (EXISTS, pipelined): a value is not read nor validated here."""
        if not keys:
            return []

        async def exists() -> list[Any]:
            pipe = self._pipeline()
            for key in keys:
                pipe.exists(key.text)
            return list(await pipe.execute())

        try:
            found = await self._call("exists", exists)
        except TierUnavailable:
            return [False] * len(keys)
        return [bool(n) for n in found]

    def _pipeline(self) -> Any:
        """A non-transactional pipeline: one round trip (per node, on a cluster), no MULTI."""
        if isinstance(self._client, RedisCluster):
            return self._client.pipeline()
        return self._client.pipeline(transaction=False)

    async def _mget(self, keys: Sequence[CacheKey]) -> list[bytes | None]:
        # decode_responses is off, so values are bytes (the stubs also allow str).
        names = [key.text for key in keys]
        if isinstance(self._client, RedisCluster):
            found = await self._client.mget_nonatomic(names)
        else:
            found = await self._client.mget(names)
        return [v.encode() if isinstance(v, str) else v for v in found]

    # -- writes --------------------------------------------------------------------------------

    def put_behind(self, key: CacheKey, value: Embedding) -> None:
        if value.nbytes > self._max_value_bytes:
            self._writes["too_large"].inc()
        elif self._breaker.state is BreakerState.OPEN:
            self._defer([(key, value)], "breaker_open")
        elif self._queued_bytes + value.nbytes > self._max_queued_bytes:
            self._writes["queue_full"].inc()
        else:
            try:
                self._queue.put_nowait((key, value))
            except asyncio.QueueFull:
                self._writes["queue_full"].inc()
            else:
                self._queued_bytes += value.nbytes
                self._queued_keys[key] += 1

    async def put_now(self, entries: Sequence[tuple[CacheKey, Embedding]]) -> None:
        """Write every entry before returning (the metadata hand-off). Always SET, even when the
        key exists: the stored value might be corrupt, and the prefill worker reads it next.

        Raises ``TooLarge`` (413 ``value_too_large``, ``index`` = position in ``entries``) and
        ``Unavailable`` (503 ``shared_tier_unavailable``) when the values cannot be stored.
        """
        for position, (key, value) in enumerate(entries):
            if value.nbytes > self._max_value_bytes:
                self._writes["too_large"].inc()
                raise TooLarge(
                    f"embedding of {value.nbytes} bytes exceeds --redis-max-value-mb; it cannot be handed "
                    f"off through the store (key {key})",
                    type="value_too_large",
                    index=position,
                )
        try:
            await self._set_many(entries)
        except TierUnavailable as exc:
            log.warning("metadata hand-off failed: %s", exc)
            raise Unavailable(
                "the shared tier (Redis) is unavailable, so the embeddings cannot be handed off",
                type="shared_tier_unavailable",
                retry_after=max(1.0, self._breaker.retry_in()),
            ) from None
        # What this request encoded was also queued behind its response: that write is done now.
        for key, _ in entries:
            if key in self._queued_keys:
                self._superseded[key] = self._queued_keys[key]

    async def _set_many(self, entries: Sequence[tuple[CacheKey, Embedding]], result: str = "written") -> None:
        """SET every entry, one pipeline per bounded chunk (items and bytes)."""
        for start in range(0, len(entries), _WRITE_BATCH_ITEMS):
            chunk: list[tuple[CacheKey, Embedding]] = []
            size = 0
            for key, value in entries[start : start + _WRITE_BATCH_ITEMS]:
                if chunk and size + value.nbytes > _WRITE_BATCH_BYTES:
                    await self._set_chunk(chunk, size, result)
                    chunk, size = [], 0
                chunk.append((key, value))
                size += value.nbytes
            await self._set_chunk(chunk, size, result)

    async def _set_chunk(self, entries: Sequence[tuple[CacheKey, Embedding]], nbytes: int, result: str) -> None:
        blobs = [(key.text, encode_value(self._spec.fingerprint, key.mm_hash, value)) for key, value in entries]

        async def write() -> None:
            pipe = self._pipeline()
            for key, blob in blobs:
                pipe.set(key, blob, ex=self._ttl)
            await pipe.execute()

        try:
            await self._call("set", write, nbytes=nbytes)
        except TierUnavailable:
            self._writes["error"].inc(len(entries))
            raise
        self._writes[result].inc(len(entries))

    async def _drain_writes(self) -> None:
        """The write-behind loop: take what is queued (bounded per batch), pipeline it, repeat."""
        while True:
            batch = [await self._queue.get()]
            size = batch[0][1].nbytes
            while len(batch) < _WRITE_BATCH_ITEMS and size < _WRITE_BATCH_BYTES and not self._queue.empty():
                batch.append(self._queue.get_nowait())
                size += batch[-1][1].nbytes
            self._queued_bytes -= size
            batch = self._not_superseded(batch)
            if not batch:
                continue
            if self._breaker.state is BreakerState.OPEN:
                self._defer(batch, "breaker_open")
                continue
            try:
                await self._set_many(batch)
                self._schedule_replay()  # a failure that did not open the breaker left some behind
            except TierRefused:
                pass  # counted; Redis is up and said no: replaying would only be refused again
            except TierUnavailable:
                self._defer(batch)  # counted as errors; replayed once the breaker closes
            except Exception:  # this task must outlive any one bad batch, or every later write is lost
                log.exception("write-behind batch of %d failed", len(batch))
                self._writes["error"].inc(len(batch))

    def _not_superseded(self, batch: list[tuple[CacheKey, Embedding]]) -> list[tuple[CacheKey, Embedding]]:
        """The dequeued writes that no hand-off has made since they were queued."""
        kept = []
        for key, value in batch:
            _take(self._queued_keys, key)
            if _take(self._superseded, key):
                self._writes["superseded"].inc()
            else:
                kept.append((key, value))
        return kept

    # -- replay ----------------------------------------------------------------------------------

    @property
    def replay_bytes(self) -> int:
        """Bytes of writes held for replay now."""
        return self._replay_bytes

    def _defer(self, entries: Sequence[tuple[CacheKey, Embedding]], missed: str | None = None) -> None:
        """Keep writes Redis missed, for :meth:`_replay_writes`; oldest out first past the budget.

        Keys are content-addressed: a key already held is not held twice. ``missed`` also counts
        the entries under that result (``breaker_open``) for continuity of the existing series."""
        for key, value in entries:
            if missed is not None:
                self._writes[missed].inc()
            if key in self._replay:
                continue
            if value.nbytes > self._max_replay_bytes:
                self._writes["replay_dropped"].inc()
                continue
            while self._replay and self._replay_bytes + value.nbytes > self._max_replay_bytes:
                _old, dropped = self._replay.popitem(last=False)
                self._replay_bytes -= dropped.nbytes
                self._writes["replay_dropped"].inc()
            self._replay[key] = value
            self._replay_bytes += value.nbytes
            self._writes["deferred"].inc()
        self._replay_gauge.set(self._replay_bytes)

    def _schedule_replay(self) -> None:
        if self._replay and (self._replay_task is None or self._replay_task.done()):
            self._replay_task = asyncio.create_task(self._replay_writes(), name="redis-replay")

    async def _replay_writes(self) -> None:
        """Write what was held, oldest first, a bounded chunk at a time, while Redis answers."""
        while self._replay and self._breaker.state is BreakerState.CLOSED:
            chunk: list[tuple[CacheKey, Embedding]] = []
            size = 0
            while self._replay and len(chunk) < _WRITE_BATCH_ITEMS and size < _WRITE_BATCH_BYTES:
                key, value = self._replay.popitem(last=False)
                chunk.append((key, value))
                size += value.nbytes
            self._replay_bytes -= size
            self._replay_gauge.set(self._replay_bytes)
            try:
                await self._set_many(chunk, "replayed")
            except TierRefused:
                log.warning("Redis refused %d replayed write(s); dropped", len(chunk))
                self._writes["replay_dropped"].inc(len(chunk))
            except TierUnavailable:
                self._defer(chunk)  # down again: keep them for the next recovery
                return
            except Exception:
                log.exception("replay of %d write(s) failed; dropped", len(chunk))
                self._writes["replay_dropped"].inc(len(chunk))

    # -- faults --------------------------------------------------------------------------------

    async def _probe(self) -> None:
        """PING now, then every ``probe_interval`` while healthy, and at the breaker's backoff while
        open: ``redis_up`` stays true with no traffic, and the tier comes back with no request."""
        while True:
            with contextlib.suppress(TierUnavailable):
                await self._call("ping", self._client.ping)
            if self._breaker.state is BreakerState.CLOSED:
                await asyncio.sleep(self._probe_interval)
            else:
                await asyncio.sleep(max(0.05, self._breaker.retry_in()))

    async def _call(self, op: RedisOp, fn: Callable[[], Awaitable[T]], *, nbytes: int = 0) -> T:
        """Run one Redis call through the breaker, under the deadline (longer for calls that move
        ``nbytes``); faults become ``TierUnavailable`` after being counted in
        ``redis_errors_total{op}``."""
        if not self._breaker.allow():
            raise TierUnavailable("circuit breaker is open")
        was = self._breaker.state
        try:
            result = await asyncio.wait_for(fn(), self._deadline + nbytes * _SECONDS_PER_BYTE)
        except ResponseError as exc:
            self._errors.labels(op=op).inc()
            self._breaker.record_success()  # Redis answered; it is up, only this command failed
            raise TierRefused(f"Redis refused {op}: {exc}") from exc
        except _OUTAGES as exc:
            self._errors.labels(op=op).inc()
            self._breaker.record_failure()
            if self._breaker.state is BreakerState.OPEN:
                self._up.set(0)
                if was is BreakerState.CLOSED:
                    log.warning("Redis unreachable (%s: %s): shared tier off until it answers", op, exc or type(exc))
            raise TierUnavailable(f"{type(exc).__name__} on {op}: {exc}") from exc
        if was is not BreakerState.CLOSED:
            log.info("Redis answers again: shared tier back on (%d byte(s) of writes to replay)", self._replay_bytes)
        self._breaker.record_success()
        self._up.set(1)
        if was is not BreakerState.CLOSED:
            self._schedule_replay()
        return result


def _take(counts: Counter[CacheKey], key: CacheKey) -> bool:
    """One less of ``key`` (none left: no entry); whether there was one."""
    n = counts.get(key, 0)
    if n > 1:
        counts[key] = n - 1
    elif n == 1:
        del counts[key]
    return n > 0
