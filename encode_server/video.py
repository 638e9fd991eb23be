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
from encode_server.core.sniff import other_modality_hint
from encode_server.core.types import VIDEO, VideoInfo

__all__ = ["decode_frames", "probe"]


def _open(data: bytes, index: int | None):  # type: ignore[no-untyped-def]
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise BadInput(f"not a readable video file: {exc}{_hint(data)}", type="invalid_video", index=index) from None
    if not container.streams.video:
        container.close()
        raise BadInput(f"the file has no video stream{_hint(data)}", type="invalid_video", index=index)
    return container


def _hint(data: bytes) -> str:
    """Where an image was sent as a video (FFmpeg opens a PNG as a one-frame stream of no rate),
    a clause saying so."""
    return other_modality_hint(data, VIDEO)


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
            f"{fps:g} fps){_hint(data)}", type="invalid_video", index=index,
        )
    return VideoInfo(width=width, height=height, num_frames=frames, fps=fps, codec=codec)


def _duration(container, stream) -> float:  # type: ignore[no-untyped-def]
    if container.duration:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return 0.0


def decode_frames(
    data: bytes, indices: Sequence[int], *, size: tuple[int, int] | None = None, index: int | None = None
) -> np.ndarray:
    """The frames at ``indices`` (sorted, repeats allowed) as ``[T, H, W, 3]`` uint8 RGB.

    A stream that ends before the last wanted frame, or fails to decode, is refused: the tokens
    were counted for every sampled frame, so a shorter video would not fit its placeholder.

    Every sampled frame must be ``size`` (height, width: the header's, which the limits and the
    request-memory budget were checked against; None: the first sampled frame's): a stream whose
    frames are larger than its header says is refused at the first such frame, before it is
    converted. The frames are written into one array as they are decoded, so what is held is the
    ``T`` frames counted from the header, once."""
    import av

    rows: dict[int, list[int]] = {}  # frame position -> its rows in the output (a set's speed per frame)
    for row, position in enumerate(indices):
        rows.setdefault(position, []).append(row)
    if not rows:
        raise BadInput("no frame to sample from the video", type="invalid_video", index=index)
    last = max(rows)
    out: np.ndarray | None = None
    found = 0
    container = _open(data, index)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for position, frame in enumerate(container.decode(stream)):
            if position in rows:
                shape = (frame.height, frame.width)
                size = size or shape
                if shape != tuple(size):
                    raise BadInput(
                        f"the video's frame {position} is {shape[1]}x{shape[0]}, not the {size[1]}x{size[0]} its "
                        "header (or first frame) gives", type="invalid_video", index=index,
                    )
                if out is None:
                    out = np.empty((len(indices), size[0], size[1], 3), dtype=np.uint8)
                out[rows[position][0]] = frame.to_ndarray(format="rgb24")
                for row in rows[position][1:]:
                    out[row] = out[rows[position][0]]
                found += 1
            if position >= last:
                break
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise BadInput(f"the video cannot be decoded at frame {found}: {exc}", type="invalid_video",
                       index=index) from None
    finally:
        container.close()
    if out is None or found < len(rows):
        missing = sorted(rows)[found]
        raise BadInput(
            f"the video ends after {found} sampled frames; its header promised frame {missing} "
            "(truncated?)", type="invalid_video", index=index,
        )
    return out
