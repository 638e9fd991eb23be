"""Audio: one file, one item. The order is a video's: the header is read and checked
(:func:`plan_audio`: ``--max-audio-seconds``, a rate the resampler can take), the family costs it
(``Encoder.plan_audio``), that cost is charged to the request-memory budget, and only then is
anything decoded (``audio.decode``), no further than the family reads, and no further than the
header says where the header states the length exactly (PCM, FLAC), as libsndfile, vLLM's reader
for those, stops there too."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from encode_server.config import Settings
from encode_server.core.errors import BadInput, TooLarge, UnsupportedMediaType
from encode_server.core.types import AUDIO, AudioInfo
from encode_server.encoders.base import AudioPlan, Encoder, PreparedItem

from .base import ItemKind, TokenCount

__all__ = ["ESTIMATE_MARGIN", "AudioKind", "plan_audio"]

T = TypeVar("T")

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


class AudioKind(ItemKind):
    """An audio file (per-request settings do not apply to it)."""

    modality = AUDIO
    plural = "audio"

    def prepare(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> PreparedItem:
        return self._decoded(data, index, self.encoder.preprocess_audio)

    def count(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> TokenCount:
        """From the header where it states the length exactly (no sample decoded); otherwise
        decoded, within its charge: an MP3's or AAC's header only estimates it (an AAC file's said
        33,024 samples and decoded to 33,792)."""
        info, _ = plan_audio(self.encoder, self.settings, data, index)
        if info.exact_length:
            num_tokens, meta = _checked(
                lambda: self.encoder.count_audio_tokens(info.num_samples, info.sample_rate), index)
        else:
            num_tokens, meta = self._decoded(
                data, index, lambda w, rate: self.encoder.count_audio_tokens(len(w), rate))
        return TokenCount(index, 0, 0, num_tokens, meta)

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
