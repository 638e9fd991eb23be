"""An ``EncodeService`` wired as the composition root wires it (``build_service``), for in-process
tests of the use case; the test owns the forward executor."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from encode_server.app import build_service
from encode_server.cache.base import SharedTier
from encode_server.config import Settings
from encode_server.encoders.base import Encoder
from encode_server.encoders.threads import MAX_AUTO_WORKERS
from encode_server.metrics import Metrics
from encode_server.service import EncodeService

__all__ = ["make_service"]


def make_service(
    encoder: Encoder, settings: Settings, metrics: Metrics, *, shared: SharedTier | None = None
) -> EncodeService:
    forward = ThreadPoolExecutor(MAX_AUTO_WORKERS, thread_name_prefix="test-forward")
    return build_service(encoder, settings, metrics, forward, shared=shared)
