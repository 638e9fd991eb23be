"""Audio files to waveforms with PyAV (its bundled FFmpeg: wav, flac, mp3, ogg/opus, m4a/aac, and
the sound track of a video container).

Two steps, as for videos (``video.py``), so that nothing is decoded before it is paid for:
``probe`` reads the first audio stream's header (rate, channels, codec, duration) without decoding
a sample, which is what the limits and the request-memory budget need; ``decode`` then decodes it
to one float32 channel at the file's own rate, as vLLM's loader hands it to its resampler.

What vLLM 0.32 does with the same bytes (``vllm/multimodal/media/audio.py``, with its audio extra
installed): libsndfile reads the formats it knows as float32 in [-1, 1] (an int16 sample ``x`` is
``x / 32768``), anything else goes to PyAV; the channels are averaged into one. FFmpeg's conversion
to planar float is the same scaling, so a WAV or FLAC decodes to the same samples here.
"""

from __future__ import annotations

import io
import itertools
import math
from fractions import Fraction

import numpy as np

from encode_server.core.errors import BadInput, TooLarge, UnsupportedMediaType
from encode_server.core.sniff import other_modality_hint
from encode_server.core.types import AUDIO, AudioInfo

__all__ = ["decode", "probe"]


def _open(data: bytes, index: int | None):  # type: ignore[no-untyped-def]
    import av

    if not data:
        raise BadInput("the audio file is empty", type="invalid_audio", index=index)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise BadInput(f"not a readable audio file ({reason}){_hint(data)}", type="invalid_audio",
                       index=index) from None
    if not container.streams.audio:
        container.close()
        raise BadInput(f"the file has no audio stream{_hint(data)}", type="invalid_audio", index=index)
    return container


def _hint(data: bytes) -> str:
    return other_modality_hint(data, AUDIO)


def probe(data: bytes, *, index: int | None = None) -> AudioInfo:
    """The first audio stream's rate, channels, codec and length in samples, no sample decoded."""
    import av

    container = _open(data, index)
    try:
        stream = container.streams.audio[0]
        ctx = stream.codec_context
        codec = ctx.name if ctx is not None else ""
        if not codec or codec not in av.codecs_available:
            raise UnsupportedMediaType(
                f"audio codec {codec or 'unknown'!r} cannot be decoded", type="unsupported_audio", index=index
            )
        rate = int(stream.rate or (ctx.sample_rate if ctx is not None else 0) or 0)
        channels = int(ctx.channels) if ctx is not None and ctx.channels else 0
        if stream.duration and stream.time_base:  # exact, as a fraction: a PCM or FLAC header's own count
            samples = math.ceil(Fraction(stream.duration) * stream.time_base * rate)
        elif container.duration:
            samples = math.ceil(Fraction(container.duration, 1_000_000) * rate)  # AV_TIME_BASE
        else:
            samples = 0
    finally:
        container.close()
    if rate <= 0 or channels <= 0 or samples <= 0:
        raise BadInput(
            f"the audio header gives no usable rate, channels or duration ({rate} Hz, {channels} channels, "
            f"{samples} samples){_hint(data)}", type="invalid_audio", index=index,
        )
    return AudioInfo(sample_rate=rate, channels=channels, num_samples=samples, codec=codec)


def decode(data: bytes, *, max_samples: int, keep_samples: int | None = None,
           index: int | None = None) -> tuple[np.ndarray, int]:
    """``(waveform, rate)``: the first audio stream as one float32 channel (the channels' mean) at
    its own rate.

    ``max_samples``: a stream that decodes to more samples than this (a header that understated its
    length) is refused, 413 ``audio_too_large``: what was charged for it is all it may take.
    ``keep_samples``: decoding stops once this many samples are in hand (the family reads no
    further: Qwen2-Audio's 30 s, plus what its resampler looks ahead)."""
    import av

    chunks: list[np.ndarray] = []
    total = 0
    stop = min(max_samples, keep_samples) if keep_samples is not None else max_samples
    container = _open(data, index)
    try:
        stream = container.streams.audio[0]
        stream.thread_type = "AUTO"
        rate = int(stream.rate or 0)
        # Planar float32 at the stream's own rate and layout: FFmpeg's scaling (int16 x / 32768)
        to_float = av.AudioResampler(format="fltp")
        for frame in itertools.chain(container.decode(stream), [None]):  # None: the resampler's flush
            for out in to_float.resample(frame):
                arr = out.to_ndarray()
                chunks.append(arr.mean(axis=0, dtype=np.float32) if arr.shape[0] > 1 else arr[0])
                total += arr.shape[-1]
            if total > stop:
                break
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise BadInput(f"the audio cannot be decoded after {total} samples: {exc}", type="invalid_audio",
                       index=index) from None
    finally:
        container.close()
    if total > max_samples:  # the file is longer than the limit, whatever its header said
        raise TooLarge(f"the audio decodes to more than the {max_samples} samples its header and the limits allow "
                       "(--max-audio-seconds)",
                       type="audio_too_large", index=index)
    if total == 0 or rate <= 0:
        raise BadInput("the audio stream holds no samples", type="invalid_audio", index=index)
    waveform = np.concatenate(chunks).astype(np.float32, copy=False)
    return (waveform[:keep_samples] if keep_samples is not None else waveform), rate
