"""``encode_server.audio``: the header read without decoding, the decode bounded by what was
charged, and every container the server's FFmpeg reads as vLLM's loader reads it."""

from __future__ import annotations

import numpy as np
import pytest

from encode_server.audio import decode, probe
from encode_server.core.errors import BadInput, TooLarge, UnsupportedMediaType
from tests.audios import FORMATS, cut_header, make_audio, samples, unknown_codec_wav


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_container_probes_and_decodes_to_one_channel_at_its_own_rate(fmt: str) -> None:
    rate = 48_000 if fmt == "opus" else 44_100
    data = make_audio(1.5, rate, 2, fmt)
    info = probe(data)
    waveform, got_rate = decode(data, max_samples=10 * rate)
    assert (info.sample_rate, info.channels, got_rate) == (rate, 2, rate)
    assert waveform.dtype == np.float32 and waveform.ndim == 1
    assert abs(len(waveform) - 1.5 * rate) < 0.05 * rate  # lossy codecs pad a frame or two
    assert info.exact_length == (fmt in ("wav", "flac"))


def test_a_wav_decodes_to_libsndfiles_samples_the_channels_averaged() -> None:
    """int16 ``x`` is ``x / 32768`` (libsndfile's float read), the channels' float32 mean."""
    pcm = (samples(0.5, 16_000, 2, seed=3) * 32767).astype(np.int16)
    expected = (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float32)
    waveform, _ = decode(make_audio(0.5, 16_000, 2, seed=3), max_samples=10**6)
    assert np.array_equal(waveform, expected)


def test_decoding_stops_where_the_family_stops_reading_and_refuses_past_the_limit() -> None:
    data = make_audio(5.0, 16_000)
    kept, _ = decode(data, max_samples=10**6, keep_samples=16_000)
    assert len(kept) == 16_000
    with pytest.raises(TooLarge) as info:  # a file longer than the limit, whatever the family reads
        decode(data, max_samples=32_000, keep_samples=480_800, index=3)
    assert (info.value.type, info.value.index) == ("audio_too_large", 3)


@pytest.mark.parametrize(("data", "error", "kind"), [
    (b"", BadInput, "invalid_audio"),
    (b"\x00" * 256, BadInput, "invalid_audio"),
    (cut_header(), BadInput, "invalid_audio"),
    (unknown_codec_wav(), UnsupportedMediaType, "unsupported_audio"),
])
def test_bad_files_are_refused_naming_the_item(data: bytes, error: type[Exception], kind: str) -> None:
    with pytest.raises(error) as info:
        probe(data, index=7)
    assert (info.value.type, info.value.index) == (kind, 7)  # type: ignore[attr-defined]
