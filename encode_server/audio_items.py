"""An audio item's way to model inputs or a token count, within what admission allows and charges.

The order is the video path's (``admission.plan_video``, then decoding): the header is read and
checked (``admission.plan_audio``: ``--max-audio-seconds``, a rate the resampler can take), the
family costs it (``Encoder.plan_audio``), that cost is charged to the request-memory budget,
and only then is anything decoded (``audio.decode``), no further than the family reads, and no
further than the header says where the header states the length exactly (PCM, FLAC), as
libsndfile, vLLM's reader for those, stops there too.

The service calls :class:`AudioItems` from its preprocessing threads; it holds no state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from encode_server.admission import MemoryCharge, plan_audio
from encode_server.config import Settings
from encode_server.core.errors import BadInput
from encode_server.encoders.base import Encoder, PreparedItem

__all__ = ["AudioItems"]

T = TypeVar("T")


class AudioItems:
    """``prepare`` (an encode's model inputs) and ``count`` (``/v1/tokens``) for audio items."""

    def __init__(self, encoder: Encoder, settings: Settings, memory: MemoryCharge) -> None:
        self.encoder = encoder
        self.settings = settings
        self.memory = memory

    def prepare(self, data: bytes, index: int) -> PreparedItem:
        return self._decoded(data, index, self.encoder.preprocess_audio)

    def count(self, data: bytes, index: int) -> tuple[int, dict[str, Any]]:
        """(N, meta): from the header where it states the length exactly (no sample decoded);
        otherwise decoded, within its charge: an MP3's or AAC's header only estimates it (an AAC
        file's said 33,024 samples and decoded to 33,792)."""
        info, _ = plan_audio(self.encoder, self.settings, data, index)
        if info.exact_length:
            return _checked(lambda: self.encoder.count_audio_tokens(info.num_samples, info.sample_rate), index)
        return self._decoded(data, index, lambda w, rate: self.encoder.count_audio_tokens(len(w), rate))

    def _decoded(self, data: bytes, index: int, then: Callable[[Any, int], T]) -> T:
        """``then(waveform, rate)`` on the samples the family reads (one channel, the file's rate),
        decoded and used within the memory its header was charged for."""
        from encode_server.audio import decode

        info, plan = plan_audio(self.encoder, self.settings, data, index)
        keep = math.inf if plan.keep_seconds is None else math.ceil(plan.keep_seconds * info.sample_rate)
        if info.exact_length:
            keep = min(keep, info.num_samples)
        limit = math.ceil(self.settings.max_audio_seconds * info.sample_rate)
        if plan.keep_seconds is None and not info.exact_length:  # no more than its estimate's bound was charged
            limit = min(limit, info.num_samples)
        with self.memory.bytes(plan.nbytes, index, "decoding this audio"):
            waveform, rate = decode(data, max_samples=limit, keep_samples=None if keep == math.inf else int(keep),
                                    index=index)
            return _checked(lambda: then(waveform, rate), index)


def _checked(step: Callable[[], T], index: int) -> T:
    try:
        return step()
    except ValueError as exc:  # e.g. too short to be represented inside the model
        raise BadInput(f"audio cannot be preprocessed: {exc}", type="invalid_audio", index=index) from exc
