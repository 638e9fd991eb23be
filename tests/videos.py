"""Short test videos, made with PyAV (the server's decoder; its bundled FFmpeg has libx264 and
libvpx-vp9): deterministic frames with detail everywhere, each frame distinct.

Also a command, for the vLLM tests (whose environment has no PyAV): ``python -m tests.videos OUT
FRAMES FPS WIDTH HEIGHT [CODEC]`` writes one file with the server's Python.
"""

from __future__ import annotations

import io
import sys
from fractions import Fraction

import numpy as np

__all__ = ["frames", "make_video"]

CONTAINERS = {"libx264": "mp4", "libvpx-vp9": "webm", "mpeg4": "mp4", "gif": "gif"}


def frames(count: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """``[count, height, width, 3]`` uint8: smooth gradients that move with the frame, plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((count, height, width, 3), dtype=np.uint8)
    for t in range(count):
        base = np.stack([x * 255 / width, y * 255 / height, np.full_like(x, (t * 37) % 256)], axis=-1)
        noise = rng.integers(-24, 25, size=(height, width, 3))
        out[t] = np.clip(base + noise, 0, 255).astype(np.uint8)
    return out


def make_video(
    count: int, fps: float, width: int, height: int, *, codec: str = "libx264", seed: int = 0,
    container_format: str | None = None, sound_rate: int | None = None,
) -> bytes:
    """A ``count``-frame video at ``fps``: H.264 in mp4 by default (lossless-ish quality, yuv420p);
    ``container_format`` another of FFmpeg's muxers (``mpegts``: a container without a magic number).
    With ``sound_rate``, a sound track as long as the frames (``tests.audios.samples``, mono), AAC in
    mp4 and Opus in webm: what a camera or a screen recording gives, for a video's own sound."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format or CONTAINERS[codec]) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "10", "preset": "veryfast"}
        sound = container.add_stream("libopus" if codec == "libvpx-vp9" else "aac", rate=sound_rate,
                                     layout="mono") if sound_rate else None
        for pixels in frames(count, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            _mux_sound(container, sound, count / fps, seed)
    return buffer.getvalue()


def _mux_sound(container, stream, seconds: float, seed: int) -> None:  # type: ignore[no-untyped-def]
    import av

    from tests.audios import samples

    rate = stream.rate
    wave = samples(seconds, rate, 1, seed)[:, 0]
    pcm = (wave * 32767).astype(np.int16) if stream.codec_context.name == "libopus" else wave
    fmt = "s16" if pcm.dtype == np.int16 else "fltp"
    step = stream.codec_context.frame_size or 1024
    for start in range(0, len(pcm), step):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[start:start + step].reshape(1, -1)),
                                           format=fmt, layout="mono")
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


if __name__ == "__main__":
    # OUT FRAMES FPS WIDTH HEIGHT CODEC, once per clip: one process makes them all.
    args = sys.argv[1:]
    for at in range(0, len(args), 6):
        out, count, fps, width, height, codec = args[at:at + 6]
        with open(out, "wb") as f:
            f.write(make_video(int(count), float(fps), int(width), int(height), codec=codec))
