"""Everything the sync and async clients share, with no I/O (httpx's habit): replica choice,
request planning, hash-first-then-upload, retries and failover, written once as generators.

Uploads (``upload=``): "adaptive" (default) asks by hash first while recent images were often
cached, and sends the bytes at once when hits have been rare (below ``min_hit_rate`` over the last
``HitWindow.size`` images), so all-miss traffic pays no extra round trip. An upload's answer says
whether the replica already held the image, so the estimate stays current in both modes.
"hash-first" always asks first; "always" never does.

A flow yields either a list of ``Call``s (the client sends them, concurrently where it can, and
sends back one outcome per call: a parsed answer or the exception it raised) or a ``Sleep``.
``Client`` and ``AsyncClient`` only drive flows; they hold no logic of their own.

Replicas: each item goes to the replica with the highest rendezvous score for its ``mm_hash``
(highest-random-weight hashing), so the same image always lands on the same replica and its local
cache, and adding or removing a replica moves only the items that scored highest there. A replica
that does not answer is marked down for ``RetryPolicy.down_for`` s; its items go to their next
replica at once.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from blake3 import blake3

from encode_client._errors import MissingExtra, ReplicaUnavailable, ServerError
from encode_client._images import AUDIO, IMAGE, VIDEO, ImageInput, Media, WireItem, media, mm_hash
from encode_client._retry import Limits, RetryPolicy
from encode_client._types import LookupItem, Result, TokenCount, UploadStats, WarmItem

__all__ = ["UPLOAD_MODES", "BaseClient", "Call", "Flow", "HitWindow", "Sleep", "gather", "rank_replicas"]

T = TypeVar("T")

UPLOAD_MODES = ("adaptive", "hash-first", "always")


class HitWindow:
    """Hit or miss of the last ``size`` images, and the adaptive decision drawn from it.

    Invariants: holds at most ``size`` outcomes; with fewer than ``min_samples`` it says
    "hash-first" (nothing known yet: the cheap-on-bytes choice); after that, "hash-first" exactly
    when the hit rate is at least ``min_hit_rate``.
    """

    def __init__(self, size: int = 64, min_hit_rate: float = 0.2, min_samples: int = 8) -> None:
        assert size >= min_samples > 0 and 0.0 <= min_hit_rate <= 1.0
        self.size = size
        self.min_hit_rate = min_hit_rate
        self.min_samples = min_samples
        self._outcomes: deque[bool] = deque(maxlen=size)
        self._hits = 0

    def record(self, hit: bool) -> None:
        if len(self._outcomes) == self.size:
            self._hits -= self._outcomes[0]
        self._outcomes.append(hit)
        self._hits += hit

    @property
    def hit_rate(self) -> float | None:
        return self._hits / len(self._outcomes) if self._outcomes else None

    def hash_first(self) -> bool:
        rate = self.hit_rate
        return rate is None or len(self._outcomes) < self.min_samples or rate >= self.min_hit_rate


@dataclass(frozen=True)
class Call:
    replica: str
    op: str  # "encode" | "lookup" | "tokens" | "model"
    payload: Any
    indices: tuple[int, ...]


@dataclass(frozen=True)
class Sleep:
    seconds: float


Flow = Generator[list[Call] | Sleep, list[Any], T]


def gather(flows: Sequence[Flow[Any]], clock: Callable[[], float] = time.monotonic) -> Flow[list[Any]]:
    """``flows`` at once, as one flow: each step sends every call the running flows ask for (the
    async client concurrently), and a flow that asks to sleep waits out its own time while the others
    go on. Gives one outcome per flow, in order: its value, or the exception it raised, so the caller
    decides which error wins."""
    outcomes: list[Any] = [None] * len(flows)
    asking: dict[int, list[Call]] = {}  # a flow -> the calls it waits on
    waking: dict[int, float] = {}  # a sleeping flow -> when it wakes (``clock``)

    def advance(i: int, answers: list[Any] | None) -> None:
        try:
            step = next(flows[i]) if answers is None else flows[i].send(answers)
        except StopIteration as stop:
            outcomes[i] = stop.value
        except Exception as exc:
            outcomes[i] = exc
        else:
            if isinstance(step, Sleep):
                waking[i] = clock() + step.seconds
            else:
                asking[i] = step

    for i in range(len(flows)):
        advance(i, None)
    while asking or waking:
        if asking:
            now_asking = dict(asking)
            asking.clear()
            answers = yield [call for calls in now_asking.values() for call in calls]
            start = 0
            for i, calls in now_asking.items():
                advance(i, answers[start : start + len(calls)])
                start += len(calls)
        elif (wait := min(waking.values()) - clock()) > 0:
            yield Sleep(wait)
        now = clock()
        for i in [i for i, at in waking.items() if at <= now]:
            del waking[i]
            advance(i, [])
    return outcomes


def rank_replicas(key: str, replicas: Sequence[str]) -> list[str]:
    """Replicas from most to least preferred for ``key`` (rendezvous hashing)."""

    def score(replica: str) -> bytes:
        return blake3(replica.encode() + b"\x00" + key.encode()).digest(length=8)

    return sorted(replicas, key=score, reverse=True)


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://", "grpc://")):
        raise ValueError(f"replica URL must start with http://, https:// or grpc://, got {url!r}")
    return url


def _require_grpc() -> None:
    """A ``grpc://`` replica needs grpcio and protobuf (the ``[grpc]`` extra): refused when the
    client is made, naming the extra, rather than by every call's ModuleNotFoundError."""
    try:
        import grpc  # noqa: F401

        from encode_client._proto import encoder_pb2_grpc  # noqa: F401  (protobuf's, the calls' stubs)
    except ImportError as exc:
        raise MissingExtra("a grpc:// replica", "grpc", exc.name) from None


class BaseClient:
    """Configuration and the flows. ``urls``: one or more replicas, ``http(s)://host:port`` or
    ``grpc://host:port``. ``response``: "safetensors" (default, compact) or "json" for HTTP."""

    def __init__(
        self,
        urls: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        response: str = "safetensors",
        retry: RetryPolicy | None = None,
        limits: Limits | None = None,
        timeout: float = 60.0,
        seed: int | None = None,
        upload: str = "adaptive",
        min_hit_rate: float = 0.2,
    ) -> None:
        replicas = [urls] if isinstance(urls, str) else list(urls)
        if not replicas:
            raise ValueError("at least one replica URL is required")
        if response not in ("safetensors", "json"):
            raise ValueError('response must be "safetensors" or "json"')
        if upload not in UPLOAD_MODES:
            raise ValueError(f"upload must be one of {UPLOAD_MODES}, not {upload!r}")
        self.upload = upload
        self._window = HitWindow(min_hit_rate=min_hit_rate)
        self._counts = {"hash_first": 0, "direct": 0, "hits": 0, "misses": 0, "bytes": 0, "switches": 0}
        self._last_mode = self._mode()
        self.replicas = [_normalize(u) for u in replicas]
        if any(r.startswith("grpc://") for r in self.replicas):
            _require_grpc()
        self.api_key = api_key
        self.response = response
        self.retry = retry or RetryPolicy()
        self.limits = limits or Limits()
        self.timeout = timeout
        self._rng = random.Random(seed)
        self._down: dict[str, float] = {}

    # -- upload mode -------------------------------------------------------------------------------

    def _mode(self) -> str:
        if self.upload == "always" or (self.upload == "adaptive" and not self._window.hash_first()):
            return "upload"
        return "hash-first"

    @property
    def stats(self) -> UploadStats:
        c = self._counts
        return UploadStats(
            mode=self._mode(), recent_hit_rate=self._window.hit_rate, hash_first_items=c["hash_first"],
            direct_items=c["direct"], hits=c["hits"], misses=c["misses"], uploaded_bytes=c["bytes"],
            switches=c["switches"],
        )

    def _observe(self, hit: bool) -> None:
        self._counts["hits" if hit else "misses"] += 1
        self._window.record(hit)
        mode = self._mode()
        if mode != self._last_mode:
            self._counts["switches"] += 1
            self._last_mode = mode

    # -- replica choice --------------------------------------------------------------------------

    def replica_for(self, key: str) -> str:
        """The live replica ``key`` goes to now (every replica down: the first choice anyway)."""
        ranked = rank_replicas(key, self.replicas)
        now = time.monotonic()
        return next((r for r in ranked if self._down.get(r, 0.0) <= now), ranked[0])

    def _mark_down(self, replica: str) -> None:
        self._down[replica] = time.monotonic() + self.retry.down_for

    def _all_down(self, keys: Sequence[str]) -> bool:
        now = time.monotonic()
        return all(self._down.get(self.replica_for(k), 0.0) > now for k in keys)

    # -- the generic round loop ------------------------------------------------------------------

    def _rounds(
        self,
        op: str,
        keys: Sequence[str],
        payload: Callable[[Sequence[int]], Any],
        chunks: Callable[[list[int]], list[list[int]]],
        caller_index: Callable[[int], int] = lambda k: k,
    ) -> Flow[dict[int, Any]]:
        """Send every index to its replica, in chunks; retry and fail over until each has an
        answer item (the answer is a list aligned with the chunk). Raises what is not retryable
        (a ``ServerError``'s ``index`` turned from the chunk's into the caller's: ``caller_index``
        maps a position in ``keys`` to it), or the last error once ``max_retries`` rounds have failed."""
        out: dict[int, Any] = {}
        pending = list(range(len(keys)))
        attempt = 0
        while pending:
            groups: dict[str, list[int]] = {}
            for i in pending:
                groups.setdefault(self.replica_for(keys[i]), []).append(i)
            calls = [
                Call(replica, op, payload(chunk), tuple(chunk))
                for replica, indices in groups.items()
                for chunk in chunks(indices)
            ]
            outcomes = yield calls
            pending, last, retry_after, only_down = [], None, None, True
            for call, outcome in zip(calls, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if not self.retry.retryable(outcome):
                        raise _in_callers_terms(outcome, call.indices, caller_index)
                    last = outcome
                    pending.extend(call.indices)
                    if isinstance(outcome, ReplicaUnavailable):
                        self._mark_down(call.replica)
                    else:
                        only_down = False
                        ra = getattr(outcome, "retry_after", None)
                        retry_after = max(retry_after or 0.0, ra) if ra is not None else retry_after
                else:
                    for i, item in zip(call.indices, outcome, strict=True):
                        out[i] = item
            if not pending:
                break
            attempt += 1
            if attempt > self.retry.max_retries:
                assert last is not None
                raise last
            if not (only_down and not self._all_down([keys[i] for i in pending])):
                yield Sleep(self.retry.delay(attempt, retry_after, self._rng))
        return out

    def _by_count(self, indices: list[int]) -> list[list[int]]:
        n = self.limits.max_items
        return [indices[i : i + n] for i in range(0, len(indices), n)]

    def _by_bytes(self, blobs: Sequence[bytes]) -> Callable[[list[int]], list[list[int]]]:
        def split(indices: list[int]) -> list[list[int]]:
            chunks: list[list[int]] = [[]]
            size = 0
            for i in indices:
                if chunks[-1] and (
                    len(chunks[-1]) >= self.limits.max_items or size + len(blobs[i]) > self.limits.max_upload_bytes
                ):
                    chunks.append([])
                    size = 0
                chunks[-1].append(i)
                size += len(blobs[i])
            return chunks

        return split

    # -- flows -----------------------------------------------------------------------------------

    @staticmethod
    def _settings(settings: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """A call's ``mm_processor_kwargs`` (None or empty: the server's defaults, sent as no field,
        so a call without them is the request it always was)."""
        if settings is not None and not isinstance(settings, Mapping):
            raise TypeError(f"mm_processor_kwargs must be a mapping, not {type(settings).__name__}")
        return settings or None

    def _encode_flow(
        self,
        images: Sequence[ImageInput],
        op: str = "encode",
        modality: str | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> Flow[list[Result]]:
        """Hash locally; ask for every distinct hash without bytes (unless the upload mode says
        to send them at once); upload only the misses, once, to the replica that missed (its
        local tier then holds them). ``op="handoff"``: the same, with ``"return": "metadata"``
        (into the shared tier; metadata and store keys back). A video goes the same way, its
        hash-only item marked as a video. ``settings``: every item's ``mm_processor_kwargs``
        (the server keys the entries under them)."""
        settings = self._settings(settings)
        inputs = [media(i, modality) for i in images]
        hashes = [mm_hash(m.data) for m in inputs]
        unique = list(dict.fromkeys(hashes))
        by_hash = {h: m for h, m in zip(hashes, inputs, strict=True)}
        first = {h: i for i, h in reversed(list(enumerate(hashes)))}  # an error names the first input
        found: dict[int, Any]
        if self._mode() == "upload":
            found = {}
            self._counts["direct"] += len(unique)
        else:
            self._counts["hash_first"] += len(unique)
            found = yield from self._rounds(
                op, unique,
                lambda ix: [WireItem(unique[i], None, by_hash[unique[i]].modality, settings=settings) for i in ix],
                self._by_count, lambda k: first[unique[k]],
            )
            for i in range(len(unique)):
                if found[i].status != "miss":
                    self._observe(True)
        missed = [h for i, h in enumerate(unique) if i not in found or found[i].status == "miss"]
        if missed:
            missed_blobs = [by_hash[h].data for h in missed]
            uploaded = yield from self._rounds(
                op, missed, lambda ix: [_upload(missed[i], by_hash[missed[i]], settings) for i in ix],
                self._by_bytes(missed_blobs), lambda k: first[missed[k]],
            )
            self._counts["bytes"] += sum(len(b) for b in missed_blobs)
            position = {h: i for i, h in enumerate(unique)}
            for j, h in enumerate(missed):
                found[position[h]] = uploaded[j]
                self._observe(uploaded[j].status == "hit")
        answers = {h: found[i] for i, h in enumerate(unique)}
        return [_reindex(answers[h], index) for index, h in enumerate(hashes)]

    def _lookup_flow(
        self, hashes: Sequence[str], modality: str = IMAGE, settings: Mapping[str, Any] | None = None
    ) -> Flow[list[LookupItem]]:
        """Which tier holds each hash as a ``modality`` item (a file's bytes as a video are
        another entry than as an image), under ``settings``."""
        if modality not in (IMAGE, VIDEO, AUDIO):
            raise ValueError(f"modality must be {IMAGE!r}, {VIDEO!r} or {AUDIO!r}, not {modality!r}")
        settings = self._settings(settings)
        keys = [h.lower() for h in hashes]
        found = yield from self._rounds(
            "lookup", keys, lambda ix: (modality, [keys[i] for i in ix], settings), self._by_count
        )
        return [found[i] for i in range(len(keys))]

    def _warm_flow(self, images: Sequence[ImageInput]) -> Flow[list[WarmItem]]:
        """Make sure each image is cached on its replica: lookup (no bytes), upload the rest.
        Unlike ``encode`` no embedding comes back for an image that is already cached."""
        inputs = [media(i) for i in images]
        hashes = [mm_hash(m.data) for m in inputs]
        cached: list[LookupItem] = [LookupItem(h, False, None) for h in hashes]
        for modality in dict.fromkeys(m.modality for m in inputs):  # one lookup per modality present
            these = [i for i, m in enumerate(inputs) if m.modality == modality]
            found = yield from self._lookup_flow([hashes[i] for i in these], modality)
            for i, item in zip(these, found, strict=True):
                cached[i] = item
        todo = [i for i, c in enumerate(cached) if not c.cached]
        encoded = yield from self._rounds(
            "encode", [hashes[i] for i in todo], lambda ix: [_upload(hashes[todo[i]], inputs[todo[i]]) for i in ix],
            self._by_bytes([inputs[i].data for i in todo]), lambda k: todo[k],
        )
        status = {todo[j]: r for j, r in encoded.items()}
        return [
            WarmItem(i, h, "hit" if i not in status else status[i].status, status[i].replica if i in status else None)
            for i, h in enumerate(hashes)
        ]

    def _tokens_flow(
        self,
        images: Sequence[ImageInput],
        sizes: Sequence[tuple[int, int]],
        settings: Mapping[str, Any] | None = None,
    ) -> Flow[list[TokenCount]]:
        if bool(images) == bool(sizes):
            raise ValueError("give either images or sizes")
        settings = self._settings(settings)
        if sizes:
            keys = [f"{w}x{h}" for w, h in sizes]
            found = yield from self._rounds(
                "tokens", keys, lambda ix: ("sizes", [sizes[i] for i in ix], settings), self._by_count
            )
        else:  # images, or videos counted from their header
            inputs = [media(i) for i in images]
            keys = [mm_hash(m.data) for m in inputs]
            found = yield from self._rounds(
                "tokens", keys, lambda ix: ("items", [_upload(None, inputs[i], settings) for i in ix], None),
                self._by_bytes([m.data for m in inputs]),
            )
        return [
            TokenCount(i, found[i].num_tokens, found[i].width, found[i].height, found[i].meta) for i in range(len(keys))
        ]

    def _model_flow(self) -> Flow[dict[str, Any]]:
        found = yield from self._rounds("model", ["model"], lambda ix: None, lambda ix: [ix])
        return dict(found[0])


def _in_callers_terms(exc: BaseException, indices: Sequence[int], caller_index: Callable[[int], int]) -> BaseException:
    """A server's error naming the caller's item: the server counts within the one request that
    failed, which the client made from a chunk of the distinct misses."""
    if not isinstance(exc, ServerError) or exc.index is None or not 0 <= exc.index < len(indices):
        return exc
    out = ServerError(exc.status, exc.type, exc.message, caller_index(indices[exc.index]),
                      retry_after=exc.retry_after, replica=exc.replica)
    out.__cause__ = exc
    return out


def _upload(hash_: str | None, m: Media, settings: Mapping[str, Any] | None = None) -> WireItem:
    return WireItem(hash_, m.data, m.modality, m.content_type, settings)


def _reindex(result: Result, index: int) -> Result:
    from dataclasses import replace

    return replace(result, index=index)
