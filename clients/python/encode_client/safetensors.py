"""The safetensors file format, written and read by hand: the one codec the server and the client share.

Why by hand: neither the client nor the server's core may need torch, and numpy has no bfloat16,
so tensors travel here as raw little-endian bytes plus a dtype name. The server imports this
module (``encode_server.core.wire`` re-exports it); the client never imports the server. The layout is the reference one
(https://github.com/huggingface/safetensors):

    [8 bytes: N, unsigned little-endian] [N bytes: JSON header] [data section]

The header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) plus an optional ``"__metadata__"`` object of str -> str. Like the
reference writer, :func:`dump_safetensors` puts ``__metadata__`` first, orders tensors by dtype
alignment (widest first) then name, and pads the header with spaces to a multiple of 8 bytes, so
that every tensor starts aligned to its item size.

:func:`load_safetensors` reads values from a shared store that may hold anything (a bug, a
truncated write, another program's key): on any input bytes it either returns tensors that are
exactly consistent with their header, or raises :class:`SafetensorsError`, nothing else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "DType",
    "SafetensorsError",
    "WireTensor",
    "bf16_to_float32",
    "dump_safetensors",
    "from_numpy",
    "load_safetensors",
    "safetensors_parts",
    "to_numpy",
]

MAX_HEADER_BYTES = 100_000_000
"""Largest JSON header accepted, as in the reference reader: a bound on what a bad length costs."""

_METADATA_KEY = "__metadata__"
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


class SafetensorsError(ValueError):
    """A blob is not a well-formed safetensors file; the message says where and why."""


WireFormatError = SafetensorsError
"""The server's historical name for :class:`SafetensorsError` (the same class)."""


@dataclass(frozen=True)
class DType:
    """One element type: our name, the safetensors code, the item size, and numpy's spelling.

    ``numpy`` is ``None`` where numpy has no such type (bfloat16). ``rank`` is the reference
    writer's dtype order, used to lay tensors out widest first.
    """

    name: str
    code: str
    itemsize: int
    numpy: str | None
    rank: int


DTYPES: Mapping[str, DType] = MappingProxyType(
    {
        d.name: d
        for d in (
            DType("bool", "BOOL", 1, "|b1", 0),
            DType("uint8", "U8", 1, "|u1", 1),
            DType("int8", "I8", 1, "|i1", 2),
            DType("int16", "I16", 2, "<i2", 3),
            DType("uint16", "U16", 2, "<u2", 4),
            DType("float16", "F16", 2, "<f2", 5),
            DType("bfloat16", "BF16", 2, None, 6),
            DType("int32", "I32", 4, "<i4", 7),
            DType("uint32", "U32", 4, "<u4", 8),
            DType("float32", "F32", 4, "<f4", 9),
            DType("float64", "F64", 8, "<f8", 10),
            DType("int64", "I64", 8, "<i8", 11),
            DType("uint64", "U64", 8, "<u8", 12),
        )
    }
)
"""Supported element types by our name ("float32", "bfloat16", ...); read-only."""

_BY_CODE: Mapping[str, DType] = {d.code: d for d in DTYPES.values()}
_BY_NUMPY: Mapping[str, DType] = {np.dtype(d.numpy).name: d for d in DTYPES.values() if d.numpy}


@dataclass(frozen=True)
class WireTensor:
    """One tensor as raw little-endian bytes, row-major.

    Invariant (checked on construction): ``dtype`` is a key of :data:`DTYPES` and
    ``len(data) == prod(shape) * itemsize``. ``data`` is always ``bytes``; a ``bytearray`` or
    ``memoryview`` is copied, so a ``WireTensor`` is immutable and hashable by value.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"tensor name must be a str, got {type(self.name).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {self.name!r}: shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.data, bytes):
            object.__setattr__(self, "data", bytes(self.data))
        expected = math.prod(shape) * DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"tensor {self.name!r}: {len(self.data)} bytes of data, but shape {list(shape)} of "
                f"{self.dtype} needs {expected}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)


def dump_safetensors(tensors: Sequence[WireTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise ``tensors`` (unique names) and optional str -> str ``metadata`` to one blob.

    ``metadata=None`` writes no ``__metadata__`` entry; an empty mapping writes an empty one.
    Raises ``ValueError`` on duplicate or reserved names and non-str metadata.
    """
    return b"".join(safetensors_parts(tensors, metadata))


def safetensors_parts(tensors: Sequence[WireTensor], metadata: Mapping[str, str] | None = None) -> list[bytes]:
    """The blob ``dump_safetensors`` returns, as the parts it is made of: the length and header,
    then each tensor's own bytes object, uncopied (a server writes them to the socket one by one)."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dupes}")
    if _METADATA_KEY in names:
        raise ValueError(f"{_METADATA_KEY!r} is reserved and cannot name a tensor")

    header: dict[str, Any] = {}
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")
        header[_METADATA_KEY] = dict(metadata)
    ordered = sorted(tensors, key=lambda t: (-DTYPES[t.dtype].rank, t.name))
    offset = 0
    for t in ordered:
        header[t.name] = {
            "dtype": DTYPES[t.dtype].code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(t.data)],
        }
        offset += len(t.data)

    try:
        header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"tensor names and metadata must be valid Unicode text: {exc}") from None
    header_bytes += b" " * (-len(header_bytes) % 8)
    return [len(header_bytes).to_bytes(8, "little") + header_bytes, *(t.data for t in ordered)]


def load_safetensors(blob: bytes | bytearray | memoryview) -> tuple[dict[str, WireTensor], dict[str, str]]:
    """Parse and strictly validate one safetensors blob into ``(tensors by name, metadata)``.

    Accepted only if: the header length fits in the blob (and under :data:`MAX_HEADER_BYTES`);
    the header is UTF-8 JSON, an object opening with ``{``, with no duplicate keys; ``__metadata__``,
    if present, maps str to str; each tensor has exactly ``dtype`` (a known code), ``shape``
    (non-negative ints) and ``data_offsets`` (two ints, begin <= end) whose length is
    ``prod(shape) * itemsize``; and the tensors tile the data section exactly: sorted by offset
    they start at 0, each begins where the previous ends (no gap, no overlap), and the last ends
    at the end of the blob. Anything else raises :class:`SafetensorsError`.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"blob must be bytes-like, got {type(blob).__name__}")
    view = memoryview(blob).cast("B")
    total = len(view)
    if total < 8:
        raise SafetensorsError(f"blob is {total} bytes; a safetensors file starts with an 8-byte header length")
    header_len = int.from_bytes(view[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header length {header_len} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if header_len > total - 8:
        raise SafetensorsError(f"header length {header_len} runs past the end of the {total}-byte blob")
    header = _parse_header(bytes(view[8 : 8 + header_len]))

    data_start = 8 + header_len
    data_len = total - data_start
    metadata = _parse_metadata(header.pop(_METADATA_KEY, None))
    entries = [(name, *_parse_entry(name, info, data_len)) for name, info in header.items()]

    expected_begin = 0
    for name, _dtype, _shape, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != expected_begin:
            kind = "a gap" if begin > expected_begin else "an overlap"
            raise SafetensorsError(
                f"tensor {name!r}: data_offsets begin at {begin}, expected {expected_begin} ({kind} in "
                f"the data section)"
            )
        expected_begin = end
    if expected_begin != data_len:
        raise SafetensorsError(f"tensors cover {expected_begin} bytes of data, but the data section holds {data_len}")

    tensors = {
        name: WireTensor(name, dtype.name, shape, bytes(view[data_start + begin : data_start + end]))
        for name, dtype, shape, begin, end in entries
    }
    return tensors, metadata


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise SafetensorsError(f"header has duplicate key {key!r}")
        obj[key] = value
    return obj


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"header is not valid UTF-8: {exc}") from None
    if not text.startswith("{"):
        raise SafetensorsError(f"header must be a JSON object starting with '{{', got {text[:16]!r}")
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except SafetensorsError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, over-long ints, deep nesting
        raise SafetensorsError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"header must be a JSON object, got {type(header).__name__}")
    return header


def _parse_metadata(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SafetensorsError(f"{_METADATA_KEY} must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise SafetensorsError(f"{_METADATA_KEY}[{key!r}] must be a string, got {type(value).__name__}")
    return raw


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_entry(name: str, info: object, data_len: int) -> tuple[DType, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name!r}: entry must be an object, got {type(info).__name__}")
    if set(info) != _TENSOR_FIELDS:
        raise SafetensorsError(
            f"tensor {name!r}: entry must have exactly the keys {sorted(_TENSOR_FIELDS)}, got {sorted(info)}"
        )
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _BY_CODE:
        raise SafetensorsError(f"tensor {name!r}: unknown dtype {code!r}; known: {sorted(_BY_CODE)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise SafetensorsError(f"tensor {name!r}: data_offsets must be two non-negative ints, got {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"tensor {name!r}: data_offsets end {end} is before begin {begin}")
    if end > data_len:
        raise SafetensorsError(f"tensor {name!r}: data_offsets end {end} is past the {data_len}-byte data section")
    dtype = _BY_CODE[code]
    expected = _nbytes(shape, dtype.itemsize)
    if end - begin != expected:
        needs = "more than 2**64 bytes" if expected is None else f"{expected} bytes"
        raise SafetensorsError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes, but shape {shape} of {code} needs {needs}"
        )
    return dtype, tuple(shape), begin, end


def _nbytes(shape: list[int], itemsize: int) -> int | None:
    """``prod(shape) * itemsize``, or ``None`` above 2**64 bytes: a hostile shape of many huge
    dimensions would otherwise cost unbounded big-integer arithmetic."""
    if 0 in shape:
        return 0
    total = itemsize
    for dim in shape:
        total *= dim
        if total > 2**64:
            return None
    return total


def to_numpy(t: WireTensor) -> np.ndarray:
    """The tensor as a numpy array of shape ``t.shape``.

    For dtypes numpy has, a read-only zero-copy view of ``t.data``. For bfloat16, a new float32
    array: bf16 is the top half of an IEEE float32, so each value is widened exactly by shifting
    its 16 bits left by 16 (no rounding; NaN and inf are preserved).
    """
    dtype = DTYPES[t.dtype]
    if dtype.numpy is None:
        return bf16_to_float32(t.data).reshape(t.shape)
    return np.frombuffer(t.data, dtype=dtype.numpy).reshape(t.shape)


def bf16_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Raw little-endian bfloat16 values widened to a flat float32 array, exactly.

    bf16 is the top half of an IEEE float32: shifting the 16 bits left by 16 is the exact value
    (NaN and inf preserved, no rounding). The one bf16 conversion of the server and the client."""
    if len(data) % 2:
        raise ValueError(f"{len(data)} bytes is not a whole number of bfloat16 values")
    return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")


def from_numpy(name: str, array: np.ndarray, *, dtype: str | None = None) -> WireTensor:
    """A :class:`WireTensor` from a numpy array, optionally converting it to ``dtype``.

    ``dtype="bfloat16"`` rounds float values to nearest-even bf16 (any NaN becomes ``0x7FC0``), the
    same as ``torch.Tensor.to(torch.bfloat16)``. Without ``dtype`` the array's own type is kept.
    """
    arr = np.asarray(array)
    if dtype is None:
        found = _BY_NUMPY.get(arr.dtype.name)
        if found is None:
            raise ValueError(f"numpy dtype {arr.dtype} has no wire dtype; pass dtype=")
        dtype = found.name
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    target = DTYPES[dtype]
    if target.numpy is None:
        data = _float32_to_bfloat16_bits(arr.astype("<f4")).tobytes()
    else:
        data = np.ascontiguousarray(arr, dtype=target.numpy).tobytes()
    return WireTensor(name, dtype, tuple(int(d) for d in arr.shape), data)


def _float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x).view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = np.where(np.isnan(x), 0x7FC0, rounded)
    return rounded.astype("<u2")
