"""``encode_server.video.decode_frames``: the frames decoded are the ones the header promised, at
the size it promised (what the limits and the request-memory budget were checked against)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest

from encode_server.core.errors import BadInput
from encode_server.video import decode_frames, probe
from tests.videos import frames, make_video


def _header_smaller_than_its_frames() -> bytes:
    """MPEG-TS H.264 whose first two frames are 640x480 and the next 240 (8 s, past FFmpeg's
    probing window) 32x32: its header says 32x32, the last size the probe saw."""
    import av

    def encode(count: int, width: int, height: int, seed: int) -> list[av.Packet]:
        codec = av.CodecContext.create("libx264", "w")
        codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
        codec.time_base, codec.framerate = Fraction(1, 30), Fraction(30)
        codec.options = {"preset": "ultrafast"}
        packets = []
        for i, pixels in enumerate(frames(count, width, height, seed)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            packets += codec.encode(frame)
        return packets + codec.encode(None)

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        n = 0
        for count, width, height in ((2, 640, 480), (240, 32, 32)):
            for packet in encode(count, width, height, n):
                packet.stream, packet.pts, packet.dts, packet.time_base = stream, n, n, Fraction(1, 30)
                container.mux(packet)
                n += 1
    return buffer.getvalue()


def test_frames_larger_than_the_header_are_refused_before_they_are_held() -> None:
    data = _header_smaller_than_its_frames()
    info = probe(data)
    assert (info.width, info.height) == (32, 32)  # the budget would be charged for 32x32 frames
    with pytest.raises(BadInput, match="frame 0 is 640x480, not the 32x32") as refused:
        decode_frames(data, [0, 1], size=(info.height, info.width), index=3)
    assert (refused.value.type, refused.value.index) == ("invalid_video", 3)


def test_a_size_change_mid_stream_is_refused_without_a_header_size() -> None:
    data = _header_smaller_than_its_frames()
    with pytest.raises(BadInput, match="frame 2 is 32x32, not the 640x480"):
        decode_frames(data, [0, 2])


def test_repeated_indices_give_the_same_frame_in_each_row() -> None:
    data = make_video(6, 3.0, 64, 48)
    out = decode_frames(data, [0, 2, 2, 5], size=(48, 64))
    assert out.shape == (4, 48, 64, 3) and out.dtype == np.uint8
    assert np.array_equal(out[1], out[2]) and np.array_equal(out[1], decode_frames(data, [2])[0])
    assert not np.array_equal(out[0], out[1])


def test_a_stream_shorter_than_its_indices_is_refused_naming_the_first_missing_frame() -> None:
    data = make_video(6, 3.0, 64, 48)
    with pytest.raises(BadInput, match="ends after 2 sampled frames; its header promised frame 9"):
        decode_frames(data, [0, 3, 9, 10])
