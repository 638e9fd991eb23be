"""SGLang's encoder messages as written here: the pickle names exactly SGLang's classes, carries every
field its receiver reads, and loads under an allow-list unpickler without running ``__init__``.

The classes are stand-ins registered under SGLang's module paths (sglang is not installed here);
tests/sglang loads the same bytes with the real wheel's ``safe_pickle_loads``."""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from encode_server.core.sglang_wire import (
    CURRENT,
    RELEASES,
    FloatTensor,
    WireError,
    embedding_message,
    error_message,
    part_req_id,
)

RECEIVER = "sglang.srt.disaggregation.encoder.receiver"
MODALITY = "sglang.srt.multimodal.modality"
# The part of SGLang 0.5.23's SafeUnpickler allow-list these messages may touch.
ALLOWED = {
    (RECEIVER, "EmbeddingData"), (MODALITY, "Modality"), ("sglang.srt.managers.schedule_batch", "Modality"),
    ("torch", "LongTensor"), ("torch", "FloatTensor"), ("torch", "bfloat16"), ("torch", "float32"),
    ("torch", "float16"), ("builtins", "list"),
}


class EmbeddingData:
    """Stand-in for SGLang's class: an unpickled message must never run its ``__init__``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling must not call __init__")


class Modality(enum.Enum):
    IMAGE = enum.auto()
    VIDEO = enum.auto()
    AUDIO = enum.auto()


class AllowList(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in ALLOWED:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        return super().find_class(module, name)


@pytest.fixture(autouse=True)
def sglang_stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for path, attrs in ((RECEIVER, {"EmbeddingData": EmbeddingData}), (MODALITY, {"Modality": Modality})):
        parts = path.split(".")
        for i in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), sys.modules.get(".".join(parts[:i]))
                                or types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(path)
        for name, obj in attrs.items():
            setattr(module, name, obj)
        monkeypatch.setitem(sys.modules, path, module)
    EmbeddingData.__module__, Modality.__module__ = RECEIVER, MODALITY
    yield


def load(frame: bytes | memoryview) -> object:
    return AllowList(io.BytesIO(bytes(frame))).load()


def globals_named(frame: bytes | memoryview) -> set[tuple[str, str]]:
    found = set()
    for op, arg, _ in pickletools.genops(bytes(frame)):
        if op.name == "GLOBAL":
            module, name = str(arg).split(" ")
            found.add((module, name))
        assert op.name not in ("STACK_GLOBAL", "INST", "OBJ", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4")
    return found


def rows(n: int, dim: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.arange(n * dim, dtype=torch.float32).reshape(n, dim).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_an_embedding_pickle_names_exactly_sglangs_class_its_modality_enum_and_torch_globals() -> None:
    frames = embedding_message(req_id="r_local_part_0", num_parts=1, part_idx=0, modality="IMAGE",
                               grids=[[1, 4, 4]], dtype="bfloat16", shape=[4, 8], data=raw(rows(4, 8)))
    assert globals_named(frames[0]) == {
        (RECEIVER, "EmbeddingData"), (MODALITY, "Modality"), ("torch", "LongTensor"), ("torch", "bfloat16"),
    }
    assert globals_named(frames[0]) <= ALLOWED


def test_every_field_sglangs_receiver_reads_is_in_the_pickle_and_init_never_runs() -> None:
    tensor = rows(6, 8)
    frames = embedding_message(req_id="abc_local_part_1", num_parts=2, part_idx=1, modality="IMAGE",
                               grids=[[1, 2, 4], [1, 2, 8]], dtype="bfloat16", shape=[6, 8], data=raw(tensor))
    assert len(frames) == 2
    obj = load(frames[0])
    assert type(obj) is EmbeddingData
    assert list(vars(obj)) == list(CURRENT.fields)
    assert (obj.req_id, obj.num_parts, obj.part_idx) == ("abc_local_part_1", 2, 1)  # type: ignore[attr-defined]
    assert obj.modality is Modality.IMAGE  # type: ignore[attr-defined]
    assert obj.dtype is torch.bfloat16 and obj.shape == [6, 8]  # type: ignore[attr-defined]
    assert obj.embedding is None and obj.send_time is None  # type: ignore[attr-defined]
    assert obj.error_msg is None and obj.error_code is None  # type: ignore[attr-defined]
    grid = obj.grid_dim  # type: ignore[attr-defined]
    assert isinstance(grid, torch.Tensor) and grid.dtype == torch.int64 and grid.tolist() == [[1, 2, 4], [1, 2, 8]]
    # What the receiver does with frame 1 (WaitingZmqRequest._extract_embedding_from_buffer).
    back = torch.frombuffer(bytearray(frames[1]), dtype=obj.dtype).reshape(obj.shape)  # type: ignore[attr-defined]
    assert torch.equal(back, tensor)


@pytest.mark.parametrize(("name", "member"), [("IMAGE", Modality.IMAGE), ("VIDEO", Modality.VIDEO),
                                              ("AUDIO", Modality.AUDIO)])
def test_the_modality_is_sglangs_enum_member_never_a_string(name: str, member: Modality) -> None:
    frames = embedding_message(req_id="r_local_part_0", num_parts=1, part_idx=0, modality=name, grids=[[3]],
                               dtype="float32", shape=[1, 2], data=bytes(8))
    assert load(frames[0]).modality is member  # type: ignore[attr-defined]


def test_a_video_parts_extras_load_as_sglangs_encoder_sends_them() -> None:
    frames = embedding_message(
        req_id="r_local_part_0", num_parts=1, part_idx=0, modality="VIDEO", grids=[[2, 4, 4], [1, 4, 4]],
        dtype="float32", shape=[12, 2], data=bytes(96),
        extras={"second_per_grid_ts": FloatTensor((1.0, 0.5)), "video_timestamps": [[0.5, 1.5], [0.25]]},
    )
    obj = load(frames[0])
    seconds = obj.second_per_grid_ts  # type: ignore[attr-defined]
    assert isinstance(seconds, torch.Tensor) and seconds.dtype == torch.float32 and seconds.tolist() == [1.0, 0.5]
    assert obj.video_timestamps == [[0.5, 1.5], [0.25]]  # type: ignore[attr-defined]
    assert list(vars(obj))[: len(CURRENT.fields)] == list(CURRENT.fields)


def test_an_error_is_one_frame_with_a_plain_int_code() -> None:
    frames = error_message(req_id="r_local_part_0", num_parts=3, part_idx=2, modality="IMAGE",
                           message="cannot identify image file", code=400)
    assert len(frames) == 1
    obj = load(frames[0])
    assert obj.error_msg == "cannot identify image file"  # type: ignore[attr-defined]
    assert type(obj.error_code) is int and obj.error_code == 400  # type: ignore[attr-defined]
    assert obj.grid_dim is None and obj.modality is Modality.IMAGE  # type: ignore[attr-defined]
    assert globals_named(frames[0]) == {(RECEIVER, "EmbeddingData"), (MODALITY, "Modality")}


def test_strings_and_large_ints_round_trip() -> None:
    frames = error_message(req_id="é✓_local_part_0", num_parts=2**40, part_idx=2**33, modality="AUDIO",
                           message="x" * 70000, code=-1)
    obj = load(frames[0])
    assert (obj.req_id, obj.num_parts, obj.part_idx) == ("é✓_local_part_0", 2**40, 2**33)  # type: ignore[attr-defined]
    assert obj.error_msg == "x" * 70000 and obj.error_code == -1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"data": bytes(10)}, "bytes for shape"),
        ({"shape": [2, 2, 2]}, "rows, dim"),
        ({"modality": "TEXT"}, "modality"),
        ({"part_idx": 1}, "part_idx"),
        ({"grids": []}, "grid row"),
        ({"extras": {"pixel_values": 1}}, "reads no"),
        ({"extras": {"second_per_grid_ts": np.float32(1.0)}}, "cannot travel"),
    ],
)
def test_a_message_sglang_would_refuse_or_misread_is_never_written(change: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"req_id": "r_local_part_0", "num_parts": 1, "part_idx": 0, "modality": "IMAGE",
                               "grids": [[1, 2, 2]], "dtype": "float32", "shape": [1, 4], "data": bytes(16)}
    with pytest.raises(WireError, match=message):
        embedding_message(**(args | change))  # type: ignore[arg-type]


def test_the_part_id_is_sglangs() -> None:
    assert part_req_id("9f2c", 3) == "9f2c_local_part_3"


def test_each_release_lists_the_fields_sglangs_receiver_needs() -> None:
    # WaitingMMRequestBase.consume_parts and MultiModalEmbeddingData read these without a default.
    needed = {"req_id", "num_parts", "part_idx", "grid_dim", "modality", "dtype", "shape", "error_msg", "error_code",
              "send_time"}
    for release in RELEASES.values():
        assert needed <= set(release.fields)
