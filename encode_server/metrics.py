"""Every metric, defined in one place, on a registry owned by one server instance.

A registry per instance (not prometheus_client's global one) lets tests run several servers in
one process and keeps the names in docs/metrics.md the only public surface.
"""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from encode_server.core.batcher import BatchStats
from encode_server.core.budget import ByteBudget

__all__ = ["CONTENT_TYPE_LATEST", "REJECT_REASONS", "Metrics", "RejectReason"]

NAMESPACE = "encode_server"

# Encoder latencies run from about a millisecond (a cache hit) to tens of seconds (a large batch
# of high-resolution images on a CPU).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# A young collection takes microseconds; a full one over an unfrozen model's heap, a tenth of a second.
GC_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

RejectReason = Literal["overloaded", "memory", "not_ready", "timeout", "unauthorized"]
"""Why ``rejected_total`` counts a refusal (docs/metrics.md); each series exists at 0 from the start,
so a dashboard's ``{reason="memory"}`` reads 0 rather than "no data" before the first one."""
REJECT_REASONS: tuple[RejectReason, ...] = get_args(RejectReason)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, namespace=NAMESPACE, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, namespace=NAMESPACE, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, namespace=NAMESPACE, registry=r, buckets=buckets)

        self.requests = counter("requests", "HTTP/gRPC requests by route and status code.", ("route", "code"))
        self.items = counter("items", "Items resolved, by status and source.", ("status", "source"))
        self.cache_lookups = counter(
            "cache_lookups",
            "Cache lookups by tier and result: hit, miss; redis also corrupt and unavailable.",
            ("tier", "result"),
        )
        self.cache_bytes = gauge("cache_bytes", "Bytes held by a cache tier.", ("tier",))
        self.cache_entries = gauge("cache_entries", "Entries held by a cache tier.", ("tier",))
        self.cache_evictions = counter("cache_evictions", "Entries evicted from a cache tier.", ("tier",))
        self.batch_size = histogram("batch_size", "Images per forward pass.", BATCH_SIZE_BUCKETS)
        self.batch_tokens = histogram("batch_tokens", "Patch tokens per forward pass.", BATCH_TOKEN_BUCKETS)
        self.queue_wait = histogram(
            "queue_wait_seconds", "Time an item waited for its batch to start.", LATENCY_BUCKETS
        )
        self.preprocess = histogram(
            "preprocess_seconds", "Decode and preprocess time per image.", LATENCY_BUCKETS
        )
        self.forward = histogram("forward_seconds", "Forward pass time per batch.", LATENCY_BUCKETS)
        stage = histogram(
            "stage_seconds",
            "The serving path's own stages, per encode request or item: read (the body, from its first "
            "byte), to_preprocess (waiting for a preprocess thread), from_preprocess (waiting for the event "
            "loop once decoded), respond (the answer made and sent, from the moment every item was resolved).",
            LATENCY_BUCKETS, ("stage",),
        )
        # Children looked up once: ``labels()`` takes a lock and builds a key on every call.
        self.stage_read, self.stage_to_preprocess, self.stage_from_preprocess, self.stage_respond = (
            stage.labels(stage=name) for name in ("read", "to_preprocess", "from_preprocess", "respond")
        )
        self.request_seconds = histogram(
            "request_seconds", "Request latency by route.", LATENCY_BUCKETS, ("route",)
        )
        self.queue_depth = gauge(
            "queue_depth",
            "Images admitted and not yet encoded (decoding, queued for a batch, or in a forward pass); "
            "--max-queue bounds it.",
        )
        self.inflight_requests = gauge("inflight_requests", "Requests being served now.")
        self.redis_errors = counter("redis_errors", "Redis errors by operation.", ("op",))
        self.redis_writes = counter(
            "redis_writes",
            "Shared-tier writes by result: written, queue_full, too_large, breaker_open, error; "
            "deferred (held for replay), replayed, replay_dropped (replay buffer full).",
            ("result",),
        )
        self.redis_replay_bytes = gauge(
            "redis_replay_bytes", "Bytes of shared-tier writes held while Redis is unavailable, to replay."
        )
        self.redis_up = gauge("redis_up", "1 when the shared Redis tier is reachable, else 0.")
        self.upload_bytes = counter("upload_bytes", "Image bytes received.")
        self.response_bytes = counter("response_bytes", "Response body bytes sent.")
        self.rejected = counter("rejected", "Requests or items refused, by reason.", ("reason",))
        self._rejected = {reason: self.rejected.labels(reason=reason) for reason in REJECT_REASONS}
        self.cache_pinned_bytes = gauge(
            "cache_pinned_bytes", "Bytes of a cache tier pinned by requests in flight.", ("tier",)
        )
        self.http_connections = gauge("http_connections", "Open HTTP connections.")
        self.connections_closed = counter(
            "connections_closed",
            "HTTP connections closed by the server's limits: header_timeout, body_timeout, max_connections, "
            "headers_too_large.",
            ("reason",),
        )
        self.inflight_bytes = gauge(
            "inflight_bytes",
            "Request bytes held in memory now (bodies, decoded base64, multipart parts, decoded pixels).",
        )
        self.inflight_bytes_limit = gauge(
            "inflight_bytes_limit", "The --max-inflight-mb budget in bytes (0: no bound)."
        )
        self.model_info = gauge(
            "model_info", "The loaded model; always 1.", ("model", "fingerprint", "dtype", "device")
        )
        self.gc_pause = histogram(
            "gc_pause_seconds", "Pauses of Python's cyclic garbage collector (every thread waits), by generation.",
            GC_PAUSE_BUCKETS, ("generation",),
        )
        # Bound once: observed from inside the collector, where nothing should take another lock.
        self._gc_pauses = tuple(self.gc_pause.labels(generation=str(g)) for g in range(3))
        self.gc_frozen_objects = gauge(
            "gc_frozen_objects", "Objects moved out of the collector's reach after the warm-up (gc.freeze)."
        )
        self._request_series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}

    def request_done(self, route: str, code: int, seconds: float, sent: int) -> None:
        """One finished request (either door). The labelled series are looked up once per
        (route, code) and kept: ``labels()`` takes a lock and builds a key on every call."""
        series = self._request_series.get((route, code))
        if series is None:
            series = self._request_series[(route, code)] = (
                self.requests.labels(route=route, code=str(code)), self.request_seconds.labels(route=route)
            )
        series[0].inc()
        series[1].observe(seconds)
        self.response_bytes.inc(sent)

    def reject(self, reason: RejectReason) -> None:
        """One refusal, counted in ``rejected_total{reason}``."""
        self._rejected[reason].inc()

    def observe_batch(self, stats: BatchStats) -> None:
        self.batch_size.observe(stats.size)
        self.batch_tokens.observe(stats.tokens)
        self.forward.observe(stats.forward_seconds)
        for wait in stats.queue_waits:
            self.queue_wait.observe(wait)

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pauses[generation].observe(seconds)

    def watch_budget(self, budget: ByteBudget) -> None:
        """Read the request-memory budget at scrape time: never a stale copy."""
        self.inflight_bytes.set_function(lambda: budget.used)
        self.inflight_bytes_limit.set(budget.capacity or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
