"""What the service lets in before it does the work, and what it charges while the work runs.

Each check comes before the cost it bounds, and refuses with the errors a client already knows
(``core/errors.py``: 503 ``overloaded`` with ``Retry-After``, 413 ``video_too_large``...):

- :class:`QueueBound`: ``--max-queue``, the items pending encode, admitted all or none per request;
- :class:`MemoryCharge`: the request-memory budget (``--max-inflight-mb``) charged with what
  decoding one item holds, from its header, before it is decoded;
- :func:`plan_video`: a video's container header checked against the video limits and planned by
  its family (``Encoder.plan_video``), before a frame is decoded;
- :func:`plan_audio`: an audio file's header checked against ``--max-audio-seconds`` and costed by
  its family (``Encoder.plan_audio``: a rate it cannot resample in bounded memory is refused),
  before a sample is decoded.

The service (``service.py``) owns single flight and the tiers; it asks this module, never the
reverse (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from encode_server.config import Settings
from encode_server.core.budget import ByteBudget
from encode_server.core.errors import BadInput, TooLarge, Unavailable, UnsupportedMediaType
from encode_server.core.types import AudioInfo, VideoInfo
from encode_server.encoders.base import AudioPlan, Encoder, VideoPlan
from encode_server.imaging import decoded_nbytes
from encode_server.metrics import Metrics

__all__ = ["Charge", "MemoryCharge", "QueueBound", "plan_audio", "plan_video"]


class QueueBound:
    """``--max-queue``: the items pending encode over all requests (admitted and not yet encoded:
    decoding, queued for a batch or in a forward pass), so that work stays bounded however fast
    requests arrive.

    The unit is the item, one cache key's encode, counted once, here. A long video is encoded as
    several parts (``Encoder.split``), but how many is known only once it is decoded and
    preprocessed, after the work this bound is there to refuse; so a video's parts ride on its one
    admission, and the batcher, which only receives admitted work, keeps no count of its own. (A
    second count, in parts, refused a split video halfway and left its first parts queued for
    nobody.) What one item holds in memory is the request-memory budget's to bound, not this.

    Invariants: ``0 <= pending <= capacity``; :meth:`admit` takes all ``n`` or none, so a request
    is refused whole, before any of its items is decoded; each admitted item is released once.
    """

    def __init__(self, capacity: int, metrics: Metrics) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._metrics = metrics
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    def fits(self, n: int) -> bool:
        """Could ``n`` more items be admitted now? (No mutation.)"""
        return self._pending + n <= self.capacity

    def admit(self, n: int) -> None:
        """Admit ``n`` items at once, or raise ``Unavailable("overloaded")`` (counted) and admit none."""
        if not self.fits(n):
            self._metrics.reject("overloaded")
            raise Unavailable(
                f"encode queue is full ({self._pending} of {self.capacity} pending, {n} more asked)",
                type="overloaded",
                retry_after=1.0,
            )
        self._pending += n

    def release(self) -> None:
        """One admitted item is done (encoded, failed or cancelled)."""
        assert self._pending > 0, "released more items than were admitted"
        self._pending -= 1


class Charge:
    """Bytes acquired from the request-memory budget for one item's preparation. ``close`` gives
    back what is not kept; a kept part goes back when the object holding it is collected, on
    whatever path (encoded, failed, or its requester gone while it decoded)."""

    def __init__(self, budget: ByteBudget | None, nbytes: int) -> None:
        self._budget = budget
        self._left = nbytes

    def keep_while_alive(self, holder: object, nbytes: int) -> None:
        kept = min(nbytes, self._left)
        if self._budget is not None and kept:
            self._left -= kept
            weakref.finalize(holder, self._budget.release, kept)

    def close(self) -> None:
        if self._budget is not None and self._left:
            self._budget.release(self._left)
        self._left = 0


class MemoryCharge:
    """The request-memory budget (the runtime's, shared with the front doors' bodies) charged with
    what decoding an item holds, before it is decoded: refused at once, 503 ``overloaded``, when
    it does not fit. ``budget`` None: nothing is charged."""

    def __init__(self, budget: ByteBudget | None, metrics: Metrics, *, max_pixels: int) -> None:
        self.budget = budget
        self._metrics = metrics
        self._max_pixels = max_pixels

    @contextmanager
    def pixels(self, data: bytes, index: int) -> Iterator[Charge]:
        """An image's decoded pixels (size from its header) for the block, and what a batched
        encoder's image holds until its batch (``PreparedItem.pending``) for as long as that lives."""
        if self.budget is None:
            yield Charge(None, 0)
            return
        nbytes = decoded_nbytes(data, max_pixels=self._max_pixels, index=index)
        with self.bytes(nbytes, index, "decoding this image") as charge:
            yield charge

    @contextmanager
    def bytes(self, nbytes: int, index: int, what: str) -> Iterator[Charge]:
        """``nbytes`` for the block (a video's ``VideoPlan.nbytes``: its family's figure); what the
        block keeps (``Charge.keep_while_alive``) outlives it."""
        if self.budget is None:
            yield Charge(None, 0)
            return
        if not self.budget.try_acquire(nbytes):
            self._metrics.reject("memory")
            raise Unavailable(
                f"request memory budget is full: {what} takes {nbytes / 2**20:.1f} MiB; retry later",
                type="overloaded", index=index, retry_after=1.0,
            )
        charge = Charge(self.budget, nbytes)
        try:
            yield charge
        finally:
            charge.close()


def plan_video(
    encoder: Encoder, settings: Settings, data: bytes, index: int, item_settings: Mapping[str, Any] | None = None
) -> tuple[VideoInfo, VideoPlan]:
    """A video's header read and checked against the limits, and its sampling planned by its family:
    before any frame is decoded (``/v1/tokens`` stops here). ``item_settings``: the item's effective
    per-request settings (their ``fps`` in place of ``--video-fps``), None for the server's."""
    from encode_server.video import probe

    s = settings
    info = probe(data, index=index)
    if info.codec == "gif":
        raise UnsupportedMediaType(
            "a GIF is an image for this model (vLLM reads its first frame): send it as an image",
            type="unsupported_video", index=index,
        )
    if info.duration > s.max_video_seconds:
        raise TooLarge(f"video is {info.duration:.1f} s long, above the limit of {s.max_video_seconds:g} s "
                       "(--max-video-seconds)",
                       type="video_too_large", index=index)
    if info.width * info.height > s.max_image_pixels:
        raise TooLarge(f"video frames are {info.width}x{info.height}, above the limit of {s.max_image_pixels} "
                       "pixels (--max-image-pixels)", type="video_too_large", index=index)
    try:
        plan = encoder.plan_video(info, float((item_settings or {}).get("fps", s.video_fps)))
    except ValueError as exc:
        raise BadInput(f"video cannot be preprocessed: {exc}", type="invalid_video", index=index) from exc
    if len(plan.indices) > s.max_video_frames:
        raise TooLarge(f"video samples {len(plan.indices)} frames, above the limit of {s.max_video_frames} "
                       "(--max-video-frames)",
                       type="video_too_large", index=index)
    # Every frame up to the last sampled one is decoded (inter-frame codecs): a header that
    # claims a high frame rate asks for that much decoding in a few seconds of "duration".
    if (decoded := max(plan.indices) + 1) > s.max_video_decoded_frames:
        raise TooLarge(f"video needs {decoded} frames decoded ({info.num_frames} at {info.fps:g} fps), above the "
                       f"limit of {s.max_video_decoded_frames} (--max-video-decoded-frames)", type="video_too_large",
                       index=index)
    return info, plan


# A header that only estimates its length (MP3, AAC, Opus: from a bitrate) is taken to hold up to this
# much more (and a second): the length ``plan_audio`` returns and the family is costed at. A family
# that reads the whole file (Qwen2.5-Omni) decodes no further: past it the item is 413.
ESTIMATE_MARGIN = 1.25


def plan_audio(encoder: Encoder, s: Settings, data: bytes, index: int) -> tuple[AudioInfo, AudioPlan]:
    """An audio file's header read and checked against ``--max-audio-seconds``, and costed by its
    family, before a sample is decoded; an estimated length is returned as its bound
    (``ESTIMATE_MARGIN``)."""
    from encode_server.audio import probe

    info = probe(data, index=index)
    if info.duration > s.max_audio_seconds:
        raise TooLarge(f"audio is {info.duration:.1f} s long, above the limit of {s.max_audio_seconds:g} s "
                       "(--max-audio-seconds)",
                       type="audio_too_large", index=index)
    if not info.exact_length:  # costed (and, where the family reads it all, decoded) up to a bound
        bound = math.ceil(info.num_samples * ESTIMATE_MARGIN) + info.sample_rate
        info = replace(info, num_samples=min(bound, math.ceil(s.max_audio_seconds * info.sample_rate)))
    try:
        return info, encoder.plan_audio(info)
    except ValueError as exc:  # e.g. a rate the resampler cannot take within bounded memory
        raise UnsupportedMediaType(f"audio cannot be taken: {exc}", type="unsupported_audio", index=index) from exc
