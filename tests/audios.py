"""Audio files for the tests, made in memory: WAV with the standard library, every other container
with PyAV's encoders (FLAC, MP3, Ogg/Opus, M4A/AAC; PyAV's FFmpeg has no Vorbis encoder), and the
bad ones the server must refuse. A chirp under seeded noise, so that different lengths and rates give different rows."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

# format -> (PyAV container, codec, sample format the encoder takes)
_ENCODED = {
    "flac": ("flac", "flac", "s16"), "mp3": ("mp3", "libmp3lame", "s16p"), "opus": ("ogg", "libopus", "s16"),
    "m4a": ("mp4", "aac", "fltp"),
}
FORMATS = ("wav", *_ENCODED)


def samples(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """``[n, channels]`` float32 in [-1, 1]: a rising chirp, louder on each further channel, under noise."""
    n = round(seconds * rate)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed + rate + n)
    tone = 0.4 * np.sin(2 * np.pi * (300 + 400 * t) * t)
    out = np.stack([tone * (0.6 + 0.4 * c) + 0.05 * rng.standard_normal(n) for c in range(channels)], 1)
    return np.clip(out, -1, 1).astype(np.float32)


def make_audio(seconds: float, rate: int = 16_000, channels: int = 1, fmt: str = "wav", seed: int = 0) -> bytes:
    """An audio file of ``seconds`` at ``rate`` Hz with ``channels``, in container ``fmt``."""
    pcm = (samples(seconds, rate, channels, seed) * 32767).astype("<i2")
    if fmt == "wav":
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as w:
            w.setnchannels(channels)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())
        return buffer.getvalue()
    import av

    container_format, codec, sample_format = _ENCODED[fmt]
    buffer = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(buffer, mode="w", format=container_format) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        step = 1024
        for start in range(0, len(pcm), step):
            chunk = pcm[start : start + step]
            data = chunk.T if sample_format.endswith("p") else chunk.reshape(1, -1)
            if sample_format == "fltp":
                data = (chunk.T / 32768).astype(np.float32)
            data = np.ascontiguousarray(data)
            frame = av.AudioFrame.from_ndarray(data, format=sample_format, layout=layout)
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def unknown_codec_wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """A WAV whose format tag (0x1ABC) names no codec FFmpeg knows: a well-formed header, no decoder."""
    data = make_audio(seconds, rate)
    return data[:20] + struct.pack("<H", 0x1ABC) + data[22:]


def truncated_wav(seconds: float = 2.0, keep: float = 0.5) -> bytes:
    """A WAV whose header promises ``seconds`` but whose data stops at ``keep`` of it (FFmpeg and
    libsndfile both read what is there: a shorter clip)."""
    data = make_audio(seconds)
    return data[: 44 + int((len(data) - 44) * keep) // 2 * 2]


def cut_header(fmt: str = "flac") -> bytes:
    """A file cut inside its header: nothing a decoder can open."""
    return make_audio(1.0, fmt=fmt)[:30]


def understated_flac(seconds: float = 20.0, claimed: int = 16_000, rate: int = 16_000) -> bytes:
    """A FLAC whose STREAMINFO claims ``claimed`` samples while its frames hold ``seconds`` of audio:
    libsndfile (vLLM's reader) stops at the claim, so must the server."""
    data = bytearray(make_audio(seconds, rate, fmt="flac"))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    packed = int.from_bytes(data[18:26], "big")  # rate 20 bits, channels 3, bits 5, total samples 36
    data[18:26] = ((packed & ~((1 << 36) - 1)) | claimed).to_bytes(8, "big")
    return bytes(data)
