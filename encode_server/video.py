"""Video files to frames with PyAV (its own bundled FFmpeg: mp4/H.264, webm/VP9, mkv, mov, GIF).

Two steps, so that nothing is decoded before it is paid for: ``probe`` reads the container's
header (size, frame count, frame rate, codec) without decoding a frame, which is all that
``/v1/tokens`` and the request-memory budget need; ``decode_frames`` then decodes the stream in
order and keeps only the sampled frames, stopping after the last one.

The frame count and rate are read as vLLM's OpenCV loader reads them (``CAP_PROP_FRAME_COUNT``,
``CAP_PROP_FPS``: the stream's ``nb_frames`` and average frame rate, the count estimated from the
duration when the container does not store it, as in webm), so the same file samples the same
frame indices here and there. Frame ``i`` is the ``i``-th frame the decoder outputs, as OpenCV's
``grab`` counts.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

from encode_server.core.errors import BadInput, UnsupportedMediaType
from encode_server.core.types import VideoInfo

__all__ = ["decode_frames", "probe"]


def _open(data: bytes, index: int | None):  # type: ignore[no-untyped-def]
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise BadInput(f"not a readable video file: {exc}", type="invalid_video", index=index) from None
    if not container.streams.video:
        container.close()
        raise BadInput("the file has no video stream", type="invalid_video", index=index)
    return container


def probe(data: bytes, *, index: int | None = None) -> VideoInfo:
    """The video's size, frame count, frame rate and codec from its header, no frame decoded."""
    import av

    container = _open(data, index)
    try:
        stream = container.streams.video[0]
        ctx = stream.codec_context
        codec = stream.codec_context.name if ctx is not None else ""
        if not codec or codec not in av.codecs_available:
            raise UnsupportedMediaType(
                f"video codec {codec or 'unknown'!r} cannot be decoded", type="unsupported_video", index=index
            )
        width, height = int(ctx.width), int(ctx.height)
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        frames = int(stream.frames or 0)
        if frames <= 0:
            duration = _duration(container, stream)
            frames = round(duration * fps) if duration > 0 and fps > 0 else 0
    finally:
        container.close()
    if width <= 0 or height <= 0 or frames <= 0 or fps <= 0:
        raise BadInput(
            f"the video header gives no usable size, frame count or rate ({width}x{height}, {frames} frames, "
            f"{fps:g} fps)", type="invalid_video", index=index,
        )
    return VideoInfo(width=width, height=height, num_frames=frames, fps=fps, codec=codec)


def _duration(container, stream) -> float:  # type: ignore[no-untyped-def]
    if container.duration:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return 0.0


def decode_frames(data: bytes, indices: Sequence[int], *, index: int | None = None) -> np.ndarray:
    """The frames at ``indices`` (sorted, repeats allowed) as ``[T, H, W, 3]`` uint8 RGB.

    A stream that ends before the last wanted frame, or fails to decode, is refused: the tokens
    were counted for every sampled frame, so a shorter video would not fit its placeholder."""
    import av

    wanted = set(indices)  # a set: a list's lookup per decoded frame was 0.2 s over a 10-minute video
    if not wanted:
        raise BadInput("no frame to sample from the video", type="invalid_video", index=index)
    last = max(wanted)
    found: dict[int, np.ndarray] = {}
    container = _open(data, index)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for position, frame in enumerate(container.decode(stream)):
            if position in wanted:
                found[position] = frame.to_ndarray(format="rgb24")
            if position >= last:
                break
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise BadInput(f"the video cannot be decoded at frame {len(found)}: {exc}", type="invalid_video",
                       index=index) from None
    finally:
        container.close()
    missing = sorted(wanted - found.keys())
    if missing:
        raise BadInput(
            f"the video ends after {len(found)} sampled frames; its header promised frame {missing[0]} "
            "(truncated?)", type="invalid_video", index=index,
        )
    shapes = {found[i].shape for i in wanted}
    if len(shapes) != 1:
        raise BadInput(f"the video changes frame size mid-stream ({sorted(shapes)})", type="invalid_video", index=index)
    return np.stack([found[i] for i in indices])
