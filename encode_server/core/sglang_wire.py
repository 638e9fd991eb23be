"""SGLang's encoder wire format: the ZMQ messages its language-only prefill takes, written without SGLang.

SGLang's prefill (``--language-only``) receives an encoder's embeddings as ZMQ multipart messages:
frame 0 is a pickled ``EmbeddingData`` (its own class), frame 1 the tensor's raw C-contiguous bytes;
an error is frame 0 alone, carrying ``error_msg`` and ``error_code``. The receiver unpickles with an
allow-list (``SafeUnpickler``: a few builtins, torch's tensor and dtype globals, ``EmbeddingData`` and
``Modality``), so the pickle may name nothing else, and, since unpickling never runs ``__init__``,
it must carry every attribute the receiver reads.

This module writes that pickle opcode by opcode (protocol 2: ``GLOBAL``, ``NEWOBJ``, ``BUILD``,
``REDUCE``) from plain values, so the server needs neither SGLang nor torch to speak it. Each SGLang
release the server speaks is one :class:`Release` in :data:`RELEASES`: where its classes live, the
``Modality`` values, and the attributes its own encoder's pickle carries, in that encoder's order
(``copy_without_embedding`` of an ``EmbeddingData``). A test reads the same pickle back with the real
wheel's ``safe_pickle_loads`` (tests/sglang).

Values a message carries, and why each is what it is:
- ``grid_dim``: ``torch.LongTensor(rows)``, one row per item of the part (``[t, h, w]`` for an image
  or a video, ``[frames]`` for audio): SGLang's encoder sends a tensor, and its receiver flattens an
  audio part's grid with ``.flatten()``, which a list has not.
- ``dtype``: the torch dtype global (``torch.bfloat16``), which ``torch.frombuffer`` reads frame 1 with.
- ``modality``: ``Modality(value)`` by ``REDUCE``, as an ``Enum`` pickles; a string fails the receiver.
- ``error_code``: a plain int (the allow-list refuses ``http.HTTPStatus``).
- family extras (``second_per_grid_ts``: ``torch.FloatTensor``, one value per video, float32 as
  SGLang's encoder computes it; ``video_timestamps``: a list per video) only where the family has them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CURRENT",
    "RELEASES",
    "SGLANG_MODALITIES",
    "Extra",
    "FloatTensor",
    "Global",
    "LongTensor",
    "Reduce",
    "Release",
    "SglangContract",
    "WireError",
    "embedding_message",
    "error_message",
    "part_req_id",
    "pickle_embedding_data",
]

SGLANG_MODALITIES = {"IMAGE": "image", "VIDEO": "video", "AUDIO": "audio"}
"""SGLang's modality names (``/encode``'s ``"modality"``) -> encode-server's."""

# What frame 1 may hold: the dtypes an embedding is stored in here, each with its byte width.
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class WireError(ValueError):
    """A message that SGLang's receiver would refuse or misread: never sent."""


@dataclass(frozen=True)
class Global:
    """A module-level name the pickle refers to (``GLOBAL module name``)."""

    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """``func(arg)`` called by the unpickler (``REDUCE``): how an ``Enum`` member pickles."""

    func: Global
    arg: object


@dataclass(frozen=True)
class LongTensor:
    """``torch.LongTensor(rows)``: an int64 tensor built by the unpickler from a list."""

    rows: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FloatTensor:
    """``torch.FloatTensor(values)``: a float32 tensor built by the unpickler from a list."""

    values: tuple[float, ...]


Value = None | bool | int | float | str | list | tuple | dict | Global | Reduce | LongTensor | FloatTensor


@dataclass(frozen=True)
class Release:
    """One SGLang release's encoder wire format, as read in its wheel.

    ``fields``: every attribute its own encoder's ``EmbeddingData`` pickle carries, in order (what
    ``__init__`` and ``copy_without_embedding`` leave on it), extras aside. ``modality_values``: its
    ``Modality`` enum's values (``enum.auto()``: 1, 2, 3).
    """

    version: str
    embedding_data: Global
    modality: Global
    modality_values: Mapping[str, int]
    fields: tuple[str, ...]
    long_tensor: Global = Global("torch", "LongTensor")
    float_tensor: Global = Global("torch", "FloatTensor")
    part_suffix: str = "_local_part_"
    extras: tuple[str, ...] = ()  # the family extras its receiver reads (``get_mm_extra_meta``)


RELEASES: dict[str, Release] = {
    "0.5.23": Release(
        version="0.5.23",
        embedding_data=Global("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
        # Where the enum is defined (schedule_batch re-exports it); both names are on the allow-list.
        modality=Global("sglang.srt.multimodal.modality", "Modality"),
        modality_values={"IMAGE": 1, "VIDEO": 2, "AUDIO": 3},
        fields=("req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time", "dtype",
                "shape", "_mr_ptr", "error_msg", "error_code"),
        extras=("video_timestamps", "second_per_grid_ts", "original_image_sizes"),
    ),
}
CURRENT = RELEASES["0.5.23"]


@dataclass(frozen=True)
class Extra:
    """A family extra SGLang's receiver reads (``attr``), from the item's ``meta`` key ``meta_key``:
    ``float32`` (one number per item, sent as ``torch.FloatTensor``) or ``list`` (a list per item).
    ``default``: the value SGLang's own encoder computes where the item's meta has none."""

    attr: str
    meta_key: str
    kind: Literal["float32", "list"]
    default: float | None = None


@dataclass(frozen=True)
class SglangContract:
    """How SGLang's language-only prefill takes a family's embeddings: declared by the family module.

    ``grids``: per modality SGLang takes from this family, the item ``meta`` key holding its grid
    (``grid_dim``'s row). ``extras``: per modality, what else its receiver reads (a video's seconds
    per temporal group, its timestamps). ``architectures``: SGLang's names for the family, from its
    encoder-disaggregation allow-list (docs and start-up messages).
    """

    grids: Mapping[str, str]
    extras: Mapping[str, tuple[Extra, ...]] = field(default_factory=dict)
    architectures: tuple[str, ...] = ()

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.grids)


def part_req_id(rid: str, part_idx: int, release: Release = CURRENT) -> str:
    """The id SGLang gives part ``part_idx`` of request ``rid`` (its receiver drops any other)."""
    return f"{rid}{release.part_suffix}{part_idx}"


def embedding_message(
    *,
    req_id: str,
    num_parts: int,
    part_idx: int,
    modality: str,
    grids: Sequence[Sequence[int]],
    dtype: str,
    shape: Sequence[int],
    data: bytes | memoryview,
    extras: Mapping[str, Value] | None = None,
    release: Release = CURRENT,
) -> list[bytes | memoryview]:
    """The two frames of one part's embedding: its ``EmbeddingData`` pickle and ``data``.

    ``modality`` is SGLang's name (``IMAGE``); ``grids`` one row per item; ``data`` the part's
    rows, C-contiguous, ``prod(shape) * itemsize`` bytes of ``dtype``."""
    if dtype not in _ITEMSIZE:
        raise WireError(f"dtype {dtype!r} is not one SGLang's receiver can rebuild here ({sorted(_ITEMSIZE)})")
    if len(shape) != 2 or any(not isinstance(d, int) or d < 0 for d in shape):
        raise WireError(f"an embedding is [rows, dim], not {list(shape)}")
    expected = shape[0] * shape[1] * _ITEMSIZE[dtype]
    if len(data) != expected:
        raise WireError(f"{len(data)} bytes for shape {list(shape)} of {dtype} ({expected} expected)")
    if not grids:
        raise WireError("a part has at least one item, and each its grid row")
    state: dict[str, Value] = {
        "req_id": req_id, "num_parts": num_parts, "part_idx": part_idx,
        "grid_dim": LongTensor(tuple(tuple(int(v) for v in row) for row in grids)),
        "modality": _modality(modality, release), "embedding": None, "send_time": None,
        "dtype": Global("torch", dtype), "shape": [int(d) for d in shape], "_mr_ptr": None,
        "error_msg": None, "error_code": None,
    }
    return [pickle_embedding_data(state, extras or {}, num_parts, part_idx, release), data]


def error_message(
    *, req_id: str, num_parts: int, part_idx: int, modality: str, message: str, code: int,
    release: Release = CURRENT,
) -> list[bytes | memoryview]:
    """The one frame that fails a part on SGLang's side: ``error_msg`` and ``error_code`` set."""
    state: dict[str, Value] = {
        "req_id": req_id, "num_parts": num_parts, "part_idx": part_idx, "grid_dim": None,
        "modality": _modality(modality, release), "embedding": None, "send_time": None, "dtype": None,
        "shape": None, "_mr_ptr": None, "error_msg": str(message), "error_code": int(code),
    }
    return [pickle_embedding_data(state, {}, num_parts, part_idx, release)]


def pickle_embedding_data(
    state: Mapping[str, Value], extras: Mapping[str, Value], num_parts: int, part_idx: int,
    release: Release = CURRENT,
) -> bytes:
    """``EmbeddingData`` with exactly ``release.fields`` (then ``extras``), as protocol-2 opcodes:
    ``GLOBAL cls; EMPTY_TUPLE; NEWOBJ`` (``cls.__new__``, no ``__init__``), then its attribute dict
    by ``BUILD``."""
    if set(state) != set(release.fields):
        raise WireError(f"fields {sorted(set(state) ^ set(release.fields))} differ from SGLang {release.version}'s")
    if stray := sorted(set(extras) - set(release.extras)):
        raise WireError(f"SGLang {release.version}'s receiver reads no {stray}")
    for name in ("num_parts", "part_idx"):
        if not isinstance(state[name], int) or isinstance(state[name], bool):
            raise WireError(f"{name} must be an int")
    if not 0 <= part_idx < num_parts:
        raise WireError(f"part_idx {part_idx} is not in [0, {num_parts})")
    if not isinstance(state["req_id"], str):
        raise WireError("req_id must be a string")
    out = bytearray(b"\x80\x02")  # PROTO 2
    _global(out, release.embedding_data)
    out += b")\x81"  # EMPTY_TUPLE, NEWOBJ: cls.__new__(cls)
    attrs = {name: state[name] for name in release.fields} | dict(extras)
    _write(out, attrs, release)
    out += b"b."  # BUILD (the dict becomes __dict__), STOP
    return bytes(out)


def _modality(name: str, release: Release) -> Reduce:
    """``Modality(value)``, as SGLang's enum member pickles."""
    if name not in release.modality_values:
        raise WireError(f"modality {name!r} is not one of SGLang's {sorted(release.modality_values)}")
    return Reduce(release.modality, release.modality_values[name])


def _global(out: bytearray, ref: Global) -> None:
    for part in (ref.module, ref.name):
        if "\n" in part or not part.isascii():
            raise WireError(f"not a global name: {ref}")
    out += b"c" + ref.module.encode() + b"\n" + ref.name.encode() + b"\n"


def _write(out: bytearray, value: object, release: Release) -> None:
    """One value, memo-free: nothing is shared, so nothing needs a back-reference."""
    if value is None:
        out += b"N"
    elif value is True:
        out += b"\x88"
    elif value is False:
        out += b"\x89"
    elif isinstance(value, int):
        if -(2**31) <= value < 2**31:
            out += b"J" + struct.pack("<i", value)  # BININT
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            if len(raw) > 255:
                raise WireError("an int too large for LONG1")
            out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)  # BINFLOAT
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    elif isinstance(value, Global):
        _global(out, value)
    elif isinstance(value, LongTensor):
        _reduce(out, release.long_tensor, [list(row) for row in value.rows], release)
    elif isinstance(value, FloatTensor):
        _reduce(out, release.float_tensor, [float(v) for v in value.values], release)
    elif isinstance(value, Reduce):
        _reduce(out, value.func, value.arg, release)
    elif isinstance(value, list):
        out += b"]"  # EMPTY_LIST
        if value:
            out += b"("  # MARK
            for item in value:
                _write(out, item, release)
            out += b"e"  # APPENDS
    elif isinstance(value, tuple):
        out += b"("
        for item in value:
            _write(out, item, release)
        out += b"t"  # TUPLE
    elif isinstance(value, dict):
        out += b"}"  # EMPTY_DICT
        if value:
            out += b"("
            for key, item in value.items():
                if not isinstance(key, str):
                    raise WireError(f"an attribute name must be a string, not {key!r}")
                _write(out, key, release)
                _write(out, item, release)
            out += b"u"  # SETITEMS
    else:
        raise WireError(f"{type(value).__name__} cannot travel to SGLang's allow-list unpickler")


def _reduce(out: bytearray, callable_: Global, arg: object, release: Release) -> None:
    """``callable_(arg)``: ``GLOBAL; arg; TUPLE1; REDUCE``."""
    _global(out, callable_)
    _write(out, arg, release)
    out += b"\x85R"  # TUPLE1, REDUCE
