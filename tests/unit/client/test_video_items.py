"""Video items in the client, without a network: what counts as a video, and what each wire sends
for one (a ``video/*`` upload, ``"modality": "video"`` in JSON, ``MODALITY_VIDEO`` over gRPC), while
an image's request stays exactly what it was before videos."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from encode_client import Video
from encode_client._base import BaseClient, Call
from encode_client._grpc import build as grpc_build
from encode_client._http import build as http_build
from encode_client._images import IMAGE, VIDEO, media, mm_hash
from encode_client._proto import encoder_pb2 as pb
from encode_client._types import Result

from tests.images import image_bytes
from tests.videos import make_video

MP4 = make_video(4, 2.0, 32, 32)
WEBM = make_video(4, 2.0, 32, 32, codec="libvpx-vp9")
GIF = make_video(4, 2.0, 32, 32, codec="gif")
PNG = image_bytes("PNG", 20, 20, seed=7)


def test_videos_are_told_by_content_suffix_or_wrapper_and_gifs_stay_images(tmp_path: Path) -> None:
    assert media(MP4)[1:] == (VIDEO, "video/mp4")
    assert media(WEBM)[1:] == (VIDEO, "video/webm")
    assert media(PNG).modality == media(GIF).modality == IMAGE  # vLLM reads a GIF as an image
    named = tmp_path / "clip.mkv"
    named.write_bytes(b"not sniffable")
    assert media(named)[1:] == (VIDEO, "video/x-matroska") and media(str(named)).modality == VIDEO
    assert media(Video(b"opaque"))[1:] == (VIDEO, "video/octet-stream")
    assert media(Video(GIF)).modality == VIDEO  # asked for: the server answers unsupported_video
    avif = b"\x00\x00\x00\x1cftypavif" + bytes(20)  # ISO-BMFF, but a still image
    assert media(avif).modality == IMAGE and media(Video(MP4)).data == MP4


def _calls(client: BaseClient, inputs: list[Any], cached: set[str], op: str = "encode") -> list[Call]:
    flow = client._encode_flow(inputs, op)
    calls: list[Call] = []
    try:
        step: Any = next(flow)
        while True:
            calls.extend(step)
            step = flow.send([
                [Result(0, i.hash, "hit" if i.hash in cached else ("miss" if i.data is None else "encoded"),
                        None, None, (), None) for i in c.payload]
                for c in step
            ])
    except StopIteration:
        return calls


def test_hash_first_asks_for_a_video_by_hash_marked_video_and_uploads_it_as_video_bytes() -> None:
    client = BaseClient("http://a:1", upload="hash-first")
    asked, uploaded = _calls(client, [MP4, PNG], cached=set())
    assert [(i.hash, i.data, i.modality) for i in asked.payload] == [(mm_hash(MP4), None, VIDEO),
                                                                     (mm_hash(PNG), None, IMAGE)]
    ask = http_build("http://a:1", "encode", asked.payload, response="json", api_key=None)
    assert ask.json == {"items": [{"hash": mm_hash(MP4), "modality": "video"}, {"hash": mm_hash(PNG)}]}
    parts = http_build("http://a:1", "encode", uploaded.payload, response="json", api_key=None).files
    assert parts is not None and [(p[1][1], p[1][2]) for p in parts] == [(MP4, "video/mp4"),
                                                                         (PNG, "application/octet-stream")]
    (one,) = _calls(BaseClient("http://a:1", upload="always"), [WEBM], cached=set())
    raw = http_build("http://a:1", "encode", one.payload, response="json", api_key=None)
    assert (raw.content, raw.headers["Content-Type"]) == (WEBM, "video/webm")
    grpc = grpc_build("encode", asked.payload)
    assert [(i.hash, i.HasField("data"), i.modality) for i in grpc.items] == [
        (mm_hash(MP4), False, pb.MODALITY_VIDEO), (mm_hash(PNG), False, pb.MODALITY_IMAGE)]
    assert grpc.items[1].SerializeToString() == pb.Item(hash=mm_hash(PNG)).SerializeToString()


def test_a_cached_video_costs_its_hash_only_and_the_hand_off_and_tokens_say_video() -> None:
    (asked,) = _calls(BaseClient("http://a:1", upload="hash-first"), [MP4], cached={mm_hash(MP4)}, op="handoff")
    body = http_build("http://a:1", "handoff", asked.payload, response="json", api_key=None).json
    assert body == {"items": [{"hash": mm_hash(MP4), "modality": "video"}], "return": "metadata"}
    flow = BaseClient("grpc://a:1")._tokens_flow([MP4, PNG], ())
    (call,) = next(flow)
    assert isinstance(call, Call)
    tokens = http_build("http://a:1", "tokens", call.payload, response="json", api_key=None).json
    assert tokens == {"items": [{"data": base64.b64encode(MP4).decode(), "modality": "video"},
                                {"data": base64.b64encode(PNG).decode()}]}
    assert [i.modality for i in grpc_build("tokens", call.payload).items] == [pb.MODALITY_VIDEO, pb.MODALITY_IMAGE]


@pytest.mark.parametrize("bad", [42, None])
def test_an_input_that_is_no_file_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="Video"):
        media(bad)
