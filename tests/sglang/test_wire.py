"""encode_server.core.sglang_wire against the real sglang wheel: the frames it writes are what SGLang
0.5.23's receiver reads, through its own allow-list unpickler and part collection, and what it pins
(class paths, fields, modality values, the part id, the extras) is what the wheel defines."""

from __future__ import annotations

import sglang
import torch
from sglang.srt.disaggregation.encoder import receiver
from sglang.srt.disaggregation.encoder.receiver import (
    EmbeddingData,
    MultiModalEmbeddingData,
    create_part_req_id,
    extract_original_req_id,
)
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.utils.common import safe_pickle_loads

from encode_server.core import sglang_wire as wire

RELEASE = wire.CURRENT


def _rows(n: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n * dim, dtype=torch.float32).reshape(n, dim) / 7 - 3).to(dtype)


def _frames(rows: torch.Tensor, dtype: str, **kwargs: object) -> list[bytes | memoryview]:
    data = rows.contiguous().view(torch.uint8).numpy().tobytes()
    defaults: dict[str, object] = {"req_id": "rid-1_local_part_0", "num_parts": 1, "part_idx": 0,
                                   "modality": "IMAGE", "grids": [[1, 4, 6]]}
    return wire.embedding_message(**(defaults | kwargs), dtype=dtype, shape=list(rows.shape), data=data)  # type: ignore[arg-type]


def test_the_wheel_in_this_environment_is_the_release_the_server_pins() -> None:
    assert sglang.__version__ == RELEASE.version


def test_the_pinned_class_paths_and_modality_values_are_the_wheels() -> None:
    assert (RELEASE.embedding_data.module, RELEASE.embedding_data.name) == (EmbeddingData.__module__,
                                                                            EmbeddingData.__qualname__)
    module = __import__(RELEASE.modality.module, fromlist=[RELEASE.modality.name])
    assert getattr(module, RELEASE.modality.name) is Modality
    assert RELEASE.modality_values == {m.name: m.value for m in Modality if m.name in RELEASE.modality_values}
    assert set(RELEASE.modality_values) == set(wire.SGLANG_MODALITIES)
    assert wire.part_req_id("abc", 3) == create_part_req_id("abc", 3)
    assert extract_original_req_id(wire.part_req_id("a_local_part_b", 1)) == "a_local_part_b"


def test_the_pinned_fields_are_every_attribute_the_wheels_encoder_sends() -> None:
    """SGLang's own encoder sends ``copy_without_embedding()`` of an ``EmbeddingData``: the pickle
    carries that object's ``__dict__``; ours must carry the same names (``__init__`` never runs)."""
    sent = EmbeddingData("r_local_part_0", 1, 0, torch.tensor([[1, 2, 2]]), Modality.IMAGE,
                         embedding=torch.zeros(1, 4)).copy_without_embedding()
    assert tuple(vars(sent)) == RELEASE.fields
    readable = set(receiver._GENERAL_VIDEO_META_ATTRS) | set(receiver._GENERAL_IMAGE_META_ATTRS)
    assert set(RELEASE.extras) <= readable, "an extra the receiver never reads"


def test_an_embedding_frame_is_accepted_by_the_allow_list_unpickler_with_every_field() -> None:
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        rows = _rows(6, 8, dtype)
        frame0, frame1 = _frames(rows, dtype_name, grids=[[1, 2, 4], [1, 2, 8]], num_parts=3, part_idx=2,
                                 req_id="rid-9_local_part_2")
        data = safe_pickle_loads(frame0)
        assert type(data) is EmbeddingData
        assert set(vars(data)) == set(RELEASE.fields)
        assert (data.req_id, data.num_parts, data.part_idx) == ("rid-9_local_part_2", 3, 2)
        assert data.modality is Modality.IMAGE
        assert isinstance(data.grid_dim, torch.Tensor) and data.grid_dim.dtype == torch.int64
        assert data.grid_dim.tolist() == [[1, 2, 4], [1, 2, 8]]
        assert data.dtype is dtype and data.shape == [6, 8]
        assert data.embedding is None and data.send_time is None and data._mr_ptr is None
        assert data.error_msg is None and data.error_code is None
        # frame 1 as the receiver rebuilds it (WaitingZmqRequest._extract_embedding_from_buffer)
        rebuilt = torch.frombuffer(bytearray(frame1), dtype=data.dtype).reshape(data.shape)
        assert torch.equal(rebuilt, rows)


def test_a_frame_folds_into_the_receivers_part_collection() -> None:
    """The part collection a prefill runs (``_aggregate_embedding_part``): two parts of a request,
    their grids and rows concatenated in part order."""
    first, second = _rows(4, 8, torch.float32), _rows(2, 8, torch.float32) + 100
    parts = []
    for idx, (rows, grid) in enumerate(((first, [[1, 4, 4]]), (second, [[1, 2, 4]]))):
        frame0, frame1 = _frames(rows, "float32", req_id=wire.part_req_id("rid", idx), num_parts=2,
                                 part_idx=idx, grids=grid)
        data = safe_pickle_loads(frame0)
        assert receiver._embedding_part_matches_request(data, "rid")
        data.embedding = torch.frombuffer(bytearray(frame1), dtype=data.dtype).reshape(data.shape).clone()
        parts.append(data)
    collected = receiver._aggregate_embedding_part(None, parts[1], model_type="qwen2_5_vl")
    assert isinstance(collected, MultiModalEmbeddingData) and not collected.ready
    collected = receiver._aggregate_embedding_part(collected, parts[0], model_type="qwen2_5_vl")
    assert collected.ready
    assert torch.equal(collected.get_embedding(is_concat=True)[Modality.IMAGE], torch.cat([first, second]))
    assert collected.get_mm_extra_meta()["img_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]


def test_a_video_frame_carries_the_extras_the_receiver_reads() -> None:
    rows = _rows(8, 4, torch.float32)
    frame0, _ = _frames(rows, "float32", modality="VIDEO", grids=[[2, 2, 4]],
                        extras={"second_per_grid_ts": wire.FloatTensor((1.25,))})
    data = safe_pickle_loads(frame0)
    assert data.modality is Modality.VIDEO
    assert isinstance(data.second_per_grid_ts, torch.Tensor)
    assert data.second_per_grid_ts.dtype == torch.float32 and data.second_per_grid_ts.tolist() == [1.25]
    data.embedding = rows
    collected = MultiModalEmbeddingData.from_embedding_data(data, model_type="qwen2_5_vl")
    meta = collected.get_mm_extra_meta()
    assert meta["video_grid_thw"].tolist() == [[2, 2, 4]]
    assert meta["second_per_grid_ts"] == [torch.tensor(1.25)]


def test_an_error_frame_is_one_frame_the_receiver_fails_the_request_with() -> None:
    frames = wire.error_message(req_id="rid_local_part_1", num_parts=2, part_idx=1, modality="IMAGE",
                                message="cannot identify image file", code=400)
    assert len(frames) == 1
    data = safe_pickle_loads(frames[0])
    assert type(data) is EmbeddingData
    assert set(vars(data)) == set(RELEASE.fields)
    assert data.error_msg == "cannot identify image file"
    assert type(data.error_code) is int and data.error_code == 400
    assert receiver._embedding_part_matches_request(data, "rid") and data.req_id == "rid"


def test_what_the_allow_list_refuses_is_never_written() -> None:
    """The wire module refuses what SGLang would refuse or misread, rather than sending it."""
    import pytest

    rows = _rows(2, 4, torch.float32)
    with pytest.raises(wire.WireError):
        _frames(rows, "float64")
    with pytest.raises(wire.WireError):
        _frames(rows, "float32", modality="image")
    with pytest.raises(wire.WireError):
        wire.embedding_message(req_id="r_local_part_0", num_parts=1, part_idx=0, modality="IMAGE",
                               grids=[[1, 2, 2]], dtype="float32", shape=[2, 4], data=b"\0" * 31)
