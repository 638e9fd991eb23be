"""The use case: items -> keys -> cache tiers -> batcher -> write-back.

HTTP and gRPC both call ``EncodeService``; neither holds any logic of its own beyond parsing and
mapping errors. The service owns the single-flight table: one encode per cache key at a time,
however many requests (or items of one request) want it. It asks an item's kind (``kinds/``) to
prepare or count it and never reads an item's bytes itself; it admits through ``admission.py``'s
``--max-queue`` bound; what ``GET /v1/model`` publishes about it is ``api/model.py``'s, from
:meth:`EncodeService.describe`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from encode_server.admission import QueueBound
from encode_server.cache.base import SharedTier
from encode_server.cache.export import FileExporter
from encode_server.cache.local import LocalTier
from encode_server.config import Settings
from encode_server.core.batcher import Batcher
from encode_server.core.errors import (
    BadInput,
    Conflict,
    EncodeServerError,
    InvalidRequest,
    Timeout,
    Unavailable,
)
from encode_server.core.hashing import CacheKey, mm_hash, parse_mm_hash
from encode_server.core.settings import RequestSettings
from encode_server.core.settings import digest as settings_digest
from encode_server.core.types import (
    ENCODER,
    IMAGE,
    Embedding,
    EncodedTensor,
    ItemResult,
    RequestItem,
    Resolved,
    Return,
)
from encode_server.encoders.base import EncoderInfo, PreparedItem
from encode_server.kinds import KINDS, ItemKind, TokenCount
from encode_server.metrics import Metrics
from encode_server.warmup import PassChoice, WarmupReport, initial_passes

__all__ = ["EncodeService", "LookupResult", "Served", "TokenCount", "Warm"]

# Hashing a large upload takes a few ms per MiB; above this it leaves the event loop.
_HASH_OFF_LOOP_BYTES = 1 << 20
# asyncio.timeout (3.11+) times the current task; wait_for runs the work as a task of its own,
# ~20 us of a cached hit's ~60 us in the server.
_IN_TASK_TIMEOUT = sys.version_info >= (3, 11)

Run = Callable[[Callable[[], Any]], Awaitable[Any]]
# The warm-up (``warmup.prepare_to_serve``, bound by the composition root): run through the batcher
# and the preprocessing threads, what it measured and how many forward passes to keep.
Warm = Callable[[Batcher[PreparedItem, EncodedTensor], Run], Awaitable[tuple[WarmupReport, PassChoice]]]


@dataclass(frozen=True)
class Served:
    """What this server serves, as its answers name it: the encoder's ``info``, its family as
    published (``Family.describe``; None: a model outside the registry), why its dtype, and the
    fingerprint of every key."""

    info: EncoderInfo
    family: dict[str, Any] | None
    dtype_reason: str
    fingerprint: str

    @property
    def model(self) -> str:
        return self.info.model_id


@dataclass(frozen=True)
class LookupResult:
    mm_hash: str
    cached: bool
    tier: str | None


@dataclass
class _Identified:
    index: int
    mm_hash: str
    key: CacheKey
    data: bytes | None
    modality: str = "image"
    settings: dict[str, Any] | None = None  # effective; None: the server's defaults


class EncodeService:
    """Resolves items through the tiers it is handed: ``local`` (this process), ``shared``
    (Redis, optional) and, last, ``batcher`` (the encoder), preparing an item's bytes with its
    ``kinds`` entry. It builds none of them: the composition root (``encode_server.app``) does, so
    a test can hand in its own."""

    def __init__(
        self,
        served: Served,
        settings: Settings,
        metrics: Metrics,
        *,
        local: LocalTier,
        batcher: Batcher[PreparedItem, EncodedTensor],
        kinds: Mapping[str, ItemKind],
        item_settings: RequestSettings,
        warm: Warm | None = None,
        shared: SharedTier | None = None,
        exporter: FileExporter | None = None,
    ) -> None:
        self.served = served
        self.settings = settings
        self.metrics = metrics
        self.shared = shared
        self.exporter = exporter  # --export-dir: vLLM's stock EC file layout (cache/export.py)
        self.kinds = dict(kinds)
        self.fingerprint = served.fingerprint
        self.item_settings = item_settings  # per-request processor settings (core/settings.py)
        self.local = local
        self.batcher = batcher
        self._preprocess_pool = ThreadPoolExecutor(
            settings.preprocess_threads, thread_name_prefix="preprocess"
        )
        # Admission (admission.py): --max-queue in items; a kind charges the request-memory budget.
        self.queue = QueueBound(settings.max_queue, metrics)
        self._warm = warm
        self.warmup: WarmupReport | None = None  # what ``start`` ran, and the peak memory it took
        self.passes = initial_passes(settings, batcher.concurrency)  # forward passes side by side
        metrics.queue_depth.set_function(lambda: self.queue.pending)
        info = served.info
        metrics.model_info.labels(
            model=info.model_id, fingerprint=self.fingerprint, dtype=info.dtype, device=info.device
        ).set(1)
        # Every (status, source) this server can count, at 0 from the start (as rejected_total).
        sources = (local.name, *((shared.name,) if shared is not None else ()))
        for status, source in (*(("hit", s) for s in sources), ("encoded", ENCODER), ("miss", "none")):
            metrics.items.labels(status=status, source=source)
        self._inflight: dict[CacheKey, asyncio.Future[Embedding]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the batcher (and the shared tier's background work) and run the warm-up it was
        handed (``warmup.py``: the family's worst case, its peak memory in ``self.warmup``):
        readiness waits for it. Raises ``WarmupFailed`` for a worst case this server cannot hold."""
        self.batcher.start()
        if self.shared is not None:
            await self.shared.start()
        if self._warm is not None:
            loop = asyncio.get_running_loop()

            async def run(work: Callable[[], Any]) -> Any:
                return await loop.run_in_executor(self._preprocess_pool, work)

            self.warmup, self.passes = await self._warm(self.batcher, run)

    async def close(self) -> None:
        await self.batcher.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        for kind in self.kinds.values():
            kind.close()
        if self.shared is not None:
            await self.shared.close()
        if self.exporter is not None:
            self.exporter.close()

    def describe(self) -> Served:
        """What this server serves: what every answer names (``model``, ``fingerprint``)."""
        return self.served

    def key_for(
        self, h: str, tenant: str | None = None, modality: str = IMAGE, settings: Mapping[str, Any] | None = None
    ) -> CacheKey:
        """The cache key of ``h`` as a ``modality`` item; with a ``tenant`` (tenant isolation) a key no
        other tenant shares. A file's bytes sent as a video never address their image's entry, nor
        an item preprocessed under other (effective) ``settings`` another's."""
        digest = settings_digest(settings) if settings is not None else None
        return CacheKey(self.fingerprint, h, self.settings.cache_prefix, tenant, modality, digest)

    # -- use cases -----------------------------------------------------------------------------

    async def encode(
        self, items: Sequence[RequestItem], *, return_kind: Return = Return.EMBEDDINGS, tenant: str | None = None
    ) -> list[ItemResult]:
        """Resolve every item: a tier hit, an encode of its bytes, or a miss (hash-only, unknown).

        With ``Return.METADATA`` (the EPD hand-off) every resolved item is also made sure to
        be in the shared tier before returning, so the caller can read it from there. ``tenant``
        goes into every cache key, so tiers and single-flight never cross tenants. Past
        ``--request-timeout``: ``Timeout`` (the encodes go on and are cached; pins are released).
        """
        timeout = self.settings.request_timeout
        try:
            if _IN_TASK_TIMEOUT:  # no task of its own: a request of local hits never leaves this one
                async with asyncio.timeout(timeout):  # type: ignore[attr-defined,unused-ignore]
                    return await self._resolve(items, return_kind, tenant)
            return await asyncio.wait_for(self._resolve(items, return_kind, tenant), timeout)
        except asyncio.TimeoutError:
            self.metrics.reject("timeout")
            raise Timeout(f"request took longer than {timeout:g} s") from None

    async def _resolve(
        self, items: Sequence[RequestItem], return_kind: Return, tenant: str | None
    ) -> list[ItemResult]:
        if return_kind is Return.METADATA and self.shared is None and self.exporter is None:
            raise Conflict(
                '"return": "metadata" needs a shared tier (start the server with --redis-url or --export-dir)',
                type="no_shared_tier",
            )
        idents = await self._identify(items, tenant)
        pinned: list[CacheKey] = []
        try:
            found = self._lookup_local(idents, pinned)
            await self._lookup_shared(idents, found, pinned)
            await self._encode_missing(idents, found, pinned)
            results = [self._result(ident, found.get(ident.key)) for ident in idents]
            if return_kind is Return.METADATA and self.shared is not None:
                await self._hand_off(results)
            if self.exporter is not None:
                files = [(r.key.identifier, r.embedding) for r in results
                         if r.embedding is not None and r.key is not None]
                if return_kind is Return.METADATA:
                    await self.exporter.export(files)  # the hand-off: on disk before the answer
                else:
                    self.exporter.export_behind(files)
            return results
        finally:
            for key in pinned:
                self.local.unpin(key)

    async def lookup(
        self,
        hashes: Sequence[object],
        *,
        tenant: str | None = None,
        modality: str = IMAGE,
        settings: Mapping[str, Any] | None = None,
    ) -> list[LookupResult]:
        """Which tier holds each hash (as a ``modality`` item, under ``settings``: the request's
        ``mm_processor_kwargs``), without moving bytes or changing recency."""
        effective = self.item_settings.effective(settings, modality)
        parsed = []
        for index, raw in enumerate(hashes):
            try:
                parsed.append(parse_mm_hash(raw))
            except EncodeServerError as exc:
                raise exc.with_index(index) from None
        keys = [self.key_for(h, tenant, modality, effective) for h in parsed]
        tiers: list[str | None] = ["local" if key in self.local else None for key in keys]
        rest = [i for i, tier in enumerate(tiers) if tier is None]
        if rest and self.shared is not None:
            present = await self.shared.contains_many([keys[i] for i in rest])
            for i, hit in zip(rest, present, strict=True):
                if hit:
                    tiers[i] = self.shared.name
        return [LookupResult(h, tier is not None, tier) for h, tier in zip(parsed, tiers, strict=True)]

    async def tokens(
        self,
        *,
        items: Sequence[RequestItem] = (),
        sizes: Sequence[Sequence[object]] = (),
        settings: Mapping[str, Any] | None = None,
    ) -> list[TokenCount]:
        """Token count and grid per image without running the encoder (routers, KV budgeting).

        From uploads (size read from the header, EXIF orientation applied as the encode path
        does) or from ``sizes`` of ``(width, height)``; exactly one of the two. Hash-only items
        have no size to read and are refused. The same limits as an encode apply. ``settings``:
        the ``mm_processor_kwargs`` of every size (an upload carries its own).
        """
        if bool(items) == bool(sizes):
            raise InvalidRequest("give either image uploads or sizes, not both and not neither")
        if sizes:
            image = self.kinds.get(IMAGE)  # a size is an image's: nothing else has one to count
            if image is None:
                raise BadInput(f"{self._takes()}: an image size counts nothing for it", type="unsupported_modality",
                               index=0)
            return [image.count_size(i, raw, self.item_settings.effective(settings, IMAGE, i))
                    for i, raw in enumerate(sizes)]
        for item in items:
            if item.data is None:
                raise InvalidRequest("a token count needs the image bytes (or use sizes)", index=item.index)
        # Off the event loop whatever the size: reading EXIF can decode a whole small-but-huge PNG.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._preprocess_pool, self._count_uploads, items)

    def _count_uploads(self, items: Sequence[RequestItem]) -> list[TokenCount]:
        # The same checks as an encode's (hash_mismatch, settings...), then each item's kind counts it.
        idents = self._identify_all(items, None)
        return [self.kinds[i.modality].count(i.data or b"", i.index, i.settings) for i in idents]

    def _takes(self) -> str:
        """``"<kind> takes images and videos only"``: the start of a refusal of a modality."""
        return f"{self.served.info.kind} takes {' and '.join(kind.plural for kind in self.kinds.values())} only"

    # -- steps ---------------------------------------------------------------------------------

    async def _identify(self, items: Sequence[RequestItem], tenant: str | None) -> list[_Identified]:
        uploaded = sum(len(item.data) for item in items if item.data is not None)
        self.metrics.upload_bytes.inc(uploaded)
        if uploaded > _HASH_OFF_LOOP_BYTES:
            return await asyncio.get_running_loop().run_in_executor(
                self._preprocess_pool, self._identify_all, items, tenant
            )
        return self._identify_all(items, tenant)

    def _identify_all(self, items: Sequence[RequestItem], tenant: str | None) -> list[_Identified]:
        out = []
        for item in items:
            try:
                if item.data is not None:
                    h = mm_hash(item.data)
                    if item.mm_hash is not None and parse_mm_hash(item.mm_hash) != h:
                        raise BadInput(
                            f"hash {item.mm_hash} does not match the data (BLAKE3 of the data is {h})",
                            type="hash_mismatch",
                        )
                elif item.mm_hash is not None:
                    h = parse_mm_hash(item.mm_hash)
                else:
                    raise BadInput("an item needs 'data', 'hash' or both", type="invalid_hash")
            except EncodeServerError as exc:
                raise exc.with_index(item.index) from None
            if item.modality not in self.kinds:
                raise BadInput(f"{self._takes()}, not {KINDS[item.modality].plural}", type="unsupported_modality",
                               index=item.index)
            effective = self.item_settings.effective(item.settings, item.modality, item.index)
            key = self.key_for(h, tenant, item.modality, effective)
            out.append(_Identified(item.index, h, key, item.data, item.modality, effective))
        return out

    def _lookup_local(self, idents: list[_Identified], pinned: list[CacheKey]) -> dict[CacheKey, Resolved]:
        found: dict[CacheKey, Resolved] = {}
        for ident in idents:
            if ident.key in found:
                continue
            value = self.local.get_and_pin(ident.key)
            if value is not None:
                pinned.append(ident.key)
                found[ident.key] = Resolved(self.local.name, value)
        return found

    async def _lookup_shared(
        self, idents: list[_Identified], found: dict[CacheKey, Resolved], pinned: list[CacheKey]
    ) -> None:
        if self.shared is None:
            return
        keys = list(dict.fromkeys(i.key for i in idents if i.key not in found and i.key not in self._inflight))
        if not keys:
            return
        for key, value in zip(keys, await self.shared.get_many(keys), strict=True):
            if value is not None:
                found[key] = Resolved(self.shared.name, value)
                if self.local.put_and_pin(key, value):
                    pinned.append(key)
            elif (local := self.local.peek(key)) is not None and self.local.pin_if_present(key):
                # An encode finished while we awaited Redis: it is local now, not a miss.
                pinned.append(key)
                found[key] = Resolved(self.local.name, local)

    async def _encode_missing(
        self, idents: list[_Identified], found: dict[CacheKey, Resolved], pinned: list[CacheKey]
    ) -> None:
        # The first item with bytes owns the encode of its key; hash-only items join an encode
        # already in flight (theirs or another request's) and are otherwise misses.
        wanted: dict[CacheKey, _Identified] = {}
        for ident in idents:
            if ident.key in found or ident.key in wanted:
                continue
            if ident.data is not None or ident.key in self._inflight:
                wanted[ident.key] = ident
        # Admitted all or none, before any is decoded: a video counts once, whatever its parts.
        if new := sum(key not in self._inflight for key in wanted):
            self.queue.admit(new)
        futures = {
            key: self._inflight.get(key) or self._start_encode(key, ident) for key, ident in wanted.items()
        }
        if not futures:
            return
        outcomes = await asyncio.gather(*(asyncio.shield(f) for f in futures.values()), return_exceptions=True)
        errors: list[EncodeServerError] = []
        for (key, ident), outcome in zip(wanted.items(), outcomes, strict=True):
            if isinstance(outcome, EncodeServerError):
                errors.append(outcome.with_index(ident.index))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                found[key] = Resolved(ENCODER, outcome)
                if self.local.pin_if_present(key):
                    pinned.append(key)
        if errors:
            error = min(errors, key=lambda e: e.index if e.index is not None else -1)
            del errors, outcomes  # a frame in the traceback must not hold the error: a cycle keeps the
            try:  # request's bytes alive until the garbage collector runs (uncounted memory)
                raise error
            finally:
                del error

    def _start_encode(self, key: CacheKey, ident: _Identified) -> asyncio.Future[Embedding]:
        assert ident.data is not None and key not in self._inflight
        future: asyncio.Future[Embedding] = asyncio.get_running_loop().create_future()
        # Mark a failure as retrieved even when every requester has gone (timed out).
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[key] = future
        task = asyncio.create_task(self._encode_one(key, ident, future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    async def _encode_one(self, key: CacheKey, ident: _Identified, future: asyncio.Future[Embedding]) -> None:
        assert ident.data is not None
        try:
            loop = asyncio.get_running_loop()
            # Announced while it decodes: an idle model waits (at most --max-wait-ms) for it to join
            # the batch of the items decoding beside it, and never waits for items not coming.
            kind = self.kinds[ident.modality]
            with self.batcher.arriving():
                queued = time.perf_counter()
                prepared, started, ended = await loop.run_in_executor(self._preprocess_pool, self._prepare, kind,
                                                                      ident)
                self.metrics.stage_to_preprocess.observe(started - queued)
                self.metrics.stage_from_preprocess.observe(time.perf_counter() - ended)
            # A long video goes in parts, each its own forward pass, so other requests' items are
            # batched between them instead of waiting behind one long pass.
            parts = kind.split(prepared, self.settings.max_batch_tokens)
            del prepared
            tensors = await asyncio.gather(*(self.batcher.submit(part, part.cost_tokens) for part in parts))
            value = Embedding(_concat(tensors), parts[0].meta)
            self.local.put(key, value)
            if self.shared is not None:
                self.shared.put_behind(key, value)
            future.set_result(value)
        except asyncio.CancelledError:
            future.set_exception(Unavailable("server is shutting down", type="not_ready"))
            raise
        except BaseException as exc:
            if isinstance(exc, EncodeServerError):  # expected: no traceback, whose frames would hold
                exc.__traceback__ = None  # the image bytes in a cycle through ``future``
            future.set_exception(exc)
        finally:
            self._inflight.pop(key, None)
            self.queue.release()

    def _prepare(self, kind: ItemKind, ident: _Identified) -> tuple[PreparedItem, float, float]:
        """The item's inputs, and when this thread started and ended them (the hand-offs' timers)."""
        assert ident.data is not None
        started = time.perf_counter()
        prepared = kind.prepare(ident.data, ident.index, ident.settings)
        ended = time.perf_counter()
        self.metrics.preprocess.observe(ended - started)
        return prepared, started, ended

    def _result(self, ident: _Identified, hit: Resolved | None) -> ItemResult:
        if hit is None:
            self.metrics.items.labels(status="miss", source="none").inc()
            return ItemResult(ident.index, ident.mm_hash, "miss", None, None, key=ident.key)
        self.metrics.items.labels(status=hit.status, source=hit.source).inc()
        return ItemResult(ident.index, ident.mm_hash, hit.status, hit.source, hit.embedding, key=ident.key)

    async def _hand_off(self, results: list[ItemResult]) -> None:
        """Write every resolved item to the shared tier now, in one round trip; a Redis hit is
        already there. Duplicates in a request are written once."""
        assert self.shared is not None
        entries: dict[CacheKey, tuple[int, Embedding]] = {}
        for result in results:
            if result.embedding is not None and result.source != self.shared.name:
                assert result.key is not None  # always set, with the tenant: never rebuild it here
                entries.setdefault(result.key, (result.index, result.embedding))
        if not entries:
            return
        try:
            await self.shared.put_now([(key, value) for key, (_, value) in entries.items()])
        except EncodeServerError as exc:
            indexes = [index for index, _ in entries.values()]
            raise exc.with_index(indexes[exc.index]) if exc.index is not None else exc from None


def _concat(tensors: Sequence[EncodedTensor]) -> EncodedTensor:
    """The rows of a video's parts, in order, as one embedding."""
    if len(tensors) == 1:
        return tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    return EncodedTensor(b"".join(t.data for t in tensors), (rows, *tensors[0].shape[1:]), tensors[0].dtype)
