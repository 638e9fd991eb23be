"""Every metric of ``encode-epd-proxy``, in one place, on a registry of its own (a process may run
several proxies, as the tests do). docs/metrics.md lists them; a test checks the list."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["NAMESPACE", "ProxyMetrics"]

NAMESPACE = "encode_epd_proxy"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, NAMESPACE
        self.requests = Counter(
            "requests", "Requests answered, by route and HTTP status.", ("route", "code"), namespace=ns, registry=r
        )
        self.request_seconds = Histogram(
            "request_seconds", "Time from a request's arrival to its answer's last byte.", ("route",),
            namespace=ns, registry=r, buckets=_LATENCY,
        )
        self.handoff_seconds = Histogram(
            "handoff_seconds", "Time to hand a chat request's images, videos and audio off to encode-server and "
            "rewrite it.",
            namespace=ns, registry=r, buckets=_LATENCY,
        )
        self.handoff_images = Counter(
            "handoff_images", "Images handed off to encode-server.", namespace=ns, registry=r
        )
        self.handoff_videos = Counter(
            "handoff_videos", "Videos handed off to encode-server (each in a call of its own).", namespace=ns,
            registry=r,
        )
        self.handoff_audios = Counter(
            "handoff_audios", "Audio items handed off to encode-server (each in a call of its own; a video's own sound "
            "under use_audio_in_video is one).", namespace=ns,
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "upstream_seconds", "Time from sending a request to vLLM to its answer's headers.", ("upstream",),
            namespace=ns, registry=r, buckets=_LATENCY,
        )
        self.retries = Counter(
            "retries", "Requests sent to vLLM again: prefill_error (vLLM failed it before answering; its images "
            "were handed off again), connect (an upstream refused the connection; another was tried), "
            "disconnected (a kept-alive connection closed before any answer; sent again on a fresh one).",
            ("reason",), namespace=ns, registry=r,
        )
        self.errors = Counter(
            "errors", "Errors the proxy answered itself, by their OpenAI error type.", ("type",),
            namespace=ns, registry=r,
        )
        self.inflight = Gauge("inflight", "Requests being served now.", namespace=ns, registry=r)
        self.outstanding = Gauge(
            "upstream_outstanding", "Requests on each vLLM upstream now.", ("upstream",), namespace=ns, registry=r
        )
        self.upstream_up = Gauge(
            "upstream_up", "1 when a vLLM upstream is taking connections, 0 while it is marked down.", ("upstream",),
            namespace=ns, registry=r,
        )
