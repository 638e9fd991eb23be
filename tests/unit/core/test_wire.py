"""The hand-written safetensors codec: round trips, agreement with the reference package both ways,
and a strict parser that only ever fails with WireFormatError."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
import safetensors.numpy as st_numpy
import safetensors.torch as st_torch  # torch is a server dependency; the core never imports it
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encode_server.core.wire import (
    DTYPES,
    MAX_HEADER_BYTES,
    WireFormatError,
    WireTensor,
    dump_safetensors,
    from_numpy,
    load_safetensors,
    to_numpy,
)

NUMPY_DTYPES = [name for name, d in DTYPES.items() if d.numpy is not None]


def _array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * DTYPES[dtype].itemsize, dtype=np.uint8)
    if dtype.startswith("float"):  # finite values, so == comparisons hold
        return rng.standard_normal(shape).astype(DTYPES[dtype].numpy)
    if dtype == "bool":
        return raw.astype(bool).reshape(shape)
    return raw.view(DTYPES[dtype].numpy).reshape(shape)


def _header(blob: bytes) -> tuple[int, bytes]:
    n = int.from_bytes(blob[:8], "little")
    return n, blob[8 : 8 + n]


def _blob(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 5), (4, 7)])
def test_round_trip_preserves_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    arr = _array(dtype, shape)
    t = from_numpy("x", arr)
    tensors, metadata = load_safetensors(dump_safetensors([t]))
    assert metadata == {}
    assert tensors == {"x": t}
    back = to_numpy(tensors["x"])
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_round_trip_preserves_bfloat16_bytes_and_metadata() -> None:
    t = WireTensor("embedding", "bfloat16", (2, 3), bytes(range(12)))
    meta = {"fingerprint": "f" * 64, "shape": "[2, 3]", "grid": "", "ünïcode": "värde"}
    tensors, metadata = load_safetensors(dump_safetensors([t], meta))
    assert tensors["embedding"] == t
    assert metadata == meta


def test_round_trip_of_many_tensors_and_empty_metadata() -> None:
    ts = [from_numpy(f"{i}", _array(dt, (i % 3 + 1, 2), i)) for i, dt in enumerate(NUMPY_DTYPES)]
    ts.append(WireTensor("bf", "bfloat16", (5,), bytes(10)))
    tensors, metadata = load_safetensors(dump_safetensors(ts, {}))
    assert metadata == {}
    assert tensors == {t.name: t for t in ts}


def test_load_accepts_bytearray_and_memoryview() -> None:
    blob = dump_safetensors([from_numpy("x", np.arange(6, dtype=np.float32))])
    assert load_safetensors(bytearray(blob)) == load_safetensors(memoryview(blob)) == load_safetensors(blob)


def test_header_is_padded_with_spaces_so_each_tensor_is_aligned() -> None:
    ts = [
        WireTensor("a", "uint8", (3,), b"abc"),
        WireTensor("b", "float64", (1,), bytes(8)),
        WireTensor("c", "bfloat16", (1,), bytes(2)),
        WireTensor("d", "int32", (1,), bytes(4)),
    ]
    blob = dump_safetensors(ts, {"k": "v"})
    n, header = _header(blob)
    assert n % 8 == 0
    assert header == header.rstrip(b" ") + b" " * (n - len(header.rstrip(b" ")))
    parsed = json.loads(header)
    assert next(iter(parsed)) == "__metadata__"
    for t in ts:
        begin = parsed[t.name]["data_offsets"][0]
        assert (8 + n + begin) % DTYPES[t.dtype].itemsize == 0


# -- agreement with the reference implementation ---------------------------------------------------


def test_dump_is_byte_identical_to_safetensors_numpy_save() -> None:
    arrays = {f"t_{dt}": _array(dt, (2, 3), i) for i, dt in enumerate(NUMPY_DTYPES)}
    ours = [from_numpy(name, arr) for name, arr in arrays.items()]
    assert dump_safetensors(ours) == st_numpy.save(arrays)
    assert dump_safetensors(ours, {"format": "np"}) == st_numpy.save(arrays, metadata={"format": "np"})


def test_reference_loads_what_we_dump() -> None:
    arrays = {f"t_{dt}": _array(dt, (4, 5), i) for i, dt in enumerate(NUMPY_DTYPES)}
    blob = dump_safetensors([from_numpy(n, a) for n, a in arrays.items()], {"a": "1", "b": "2"})
    loaded = st_numpy.load(blob)
    assert loaded.keys() == arrays.keys()
    for name, arr in arrays.items():
        assert loaded[name].dtype == arr.dtype
        np.testing.assert_array_equal(loaded[name], arr)


def test_we_load_what_the_reference_dumps() -> None:
    arrays = {f"t_{dt}": _array(dt, (3, 0, 2) if i == 2 else (3, 4), i) for i, dt in enumerate(NUMPY_DTYPES)}
    tensors, metadata = load_safetensors(st_numpy.save(arrays, metadata={"x": "y", "z": ""}))
    assert metadata == {"x": "y", "z": ""}
    assert tensors.keys() == arrays.keys()
    for name, arr in arrays.items():
        np.testing.assert_array_equal(to_numpy(tensors[name]), arr)


def test_bfloat16_from_the_reference_torch_writer_widens_exactly() -> None:
    x = torch.randn(6, 9).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, 3.0e38]).to(torch.bfloat16)
    blob = st_torch.save({"x": x, "special": special}, metadata={"k": "v"})
    tensors, metadata = load_safetensors(blob)
    assert metadata == {"k": "v"}
    assert tensors["x"].dtype == "bfloat16" and tensors["x"].shape == (6, 9)
    np.testing.assert_array_equal(to_numpy(tensors["x"]), x.float().numpy())
    np.testing.assert_array_equal(to_numpy(tensors["special"]), special.float().numpy())
    nan = load_safetensors(st_torch.save({"n": torch.tensor([float("nan")], dtype=torch.bfloat16)}))[0]
    assert np.isnan(to_numpy(nan["n"])).all()


def test_reference_torch_reader_loads_our_bfloat16() -> None:
    values = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    blob = dump_safetensors([from_numpy("embedding", values, dtype="bfloat16")], {"grid": "[1, 2, 2]"})
    loaded = st_torch.load(blob)["embedding"]
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded, torch.from_numpy(values).to(torch.bfloat16))


def test_from_numpy_bfloat16_rounds_exactly_like_torch() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, size=20_000, dtype=np.uint64).astype(np.uint32)
    edge = np.array(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80000000, 0x7F800000, 0xFF800000],
        dtype=np.uint32,
    )  # ties to even (both ways), round up, overflow to inf, subnormal, -0, +-inf
    values = np.concatenate([bits, edge]).view(np.float32)
    ours = np.frombuffer(from_numpy("x", values, dtype="bfloat16").data, dtype="<u2")
    theirs = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    assert np.isnan(to_numpy(WireTensor("n", "bfloat16", (int((~finite).sum()),), ours[~finite].tobytes()))).all()


def test_to_numpy_widens_bfloat16_bit_patterns() -> None:
    patterns = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x3EAB], dtype="<u2")
    got = to_numpy(WireTensor("x", "bfloat16", (7,), patterns.tobytes()))
    assert got.dtype == np.float32
    expected = [1.0, -2.0, 0.0, -0.0, np.inf, -np.inf, struct.unpack("<f", b"\x00\x00\xab\x3e")[0]]
    np.testing.assert_array_equal(got, np.array(expected, dtype=np.float32))
    assert np.signbit(got[3])
    assert np.isnan(to_numpy(WireTensor("n", "bfloat16", (1,), b"\xc0\x7f"))).all()


def test_to_numpy_is_a_read_only_view_for_numpy_dtypes() -> None:
    arr = to_numpy(from_numpy("x", np.arange(4, dtype=np.int64)))
    assert not arr.flags.writeable


# -- construction and dump errors ------------------------------------------------------------------


def test_wire_tensor_rejects_data_inconsistent_with_shape() -> None:
    with pytest.raises(ValueError, match="needs 8"):
        WireTensor("x", "float32", (2,), bytes(7))


def test_wire_tensor_rejects_unknown_dtype_and_bad_shape() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        WireTensor("x", "complex64", (1,), bytes(8))
    with pytest.raises(ValueError, match="shape"):
        WireTensor("x", "uint8", (-1,), b"")
    with pytest.raises(ValueError, match="shape"):
        WireTensor("x", "uint8", (True,), b"x")


def test_wire_tensor_normalises_shape_and_data_types() -> None:
    t = WireTensor("x", "uint8", [2], bytearray(b"ab"))  # type: ignore[arg-type]
    assert t.shape == (2,) and type(t.data) is bytes
    assert t == WireTensor("x", "uint8", (2,), b"ab")


def test_dump_rejects_duplicate_and_reserved_names() -> None:
    t = WireTensor("x", "uint8", (1,), b"a")
    with pytest.raises(ValueError, match="duplicate"):
        dump_safetensors([t, t])
    with pytest.raises(ValueError, match="reserved"):
        dump_safetensors([WireTensor("__metadata__", "uint8", (1,), b"a")])


def test_dump_rejects_non_string_metadata() -> None:
    with pytest.raises(ValueError, match="str to str"):
        dump_safetensors([], {"shape": [1, 2]})  # type: ignore[dict-item]


def test_from_numpy_rejects_types_without_a_wire_dtype() -> None:
    with pytest.raises(ValueError):
        from_numpy("x", np.zeros(2, dtype=np.complex64))


# -- strict parsing: each malformed input names what is wrong --------------------------------------

GOOD_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "8-byte header length"),
        (b"\x02\x00\x00", "8-byte header length"),
        ((100).to_bytes(8, "little") + b"{}", "runs past the end"),
        ((MAX_HEADER_BYTES + 1).to_bytes(8, "little"), "exceeds the limit"),
        (b"\xff" * 8 + b"{}", "exceeds the limit"),
        (_blob(None, raw=b"\xff\xfe{}"), "not valid UTF-8"),
        (_blob(None, raw=b"[]"), "starting with '{'"),
        (_blob(None, raw=b" {}"), "starting with '{'"),
        (_blob(None, raw=b""), "starting with '{'"),
        (_blob(None, raw=b"{"), "not valid JSON"),
        (_blob(None, raw=b'{"a": 1} x'), "not valid JSON"),
        (_blob(None, raw=b'{"a":' + b"[" * 100_000), "not valid JSON"),
        (_blob(None, raw=b'{"a": ' + b"9" * 5000 + b"}"), "not valid JSON"),
        (_blob(None, raw=b'{"x": {}, "x": {}}'), "duplicate key 'x'"),
        (_blob({"__metadata__": []}), "must be an object"),
        (_blob({"__metadata__": {"a": 1}}), "must be a string"),
        (_blob({"__metadata__": {"a": None}}), "must be a string"),
        (_blob({"x": [1, 2]}), "entry must be an object"),
        (_blob({"x": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly the keys"),
        (_blob({"x": {**GOOD_ENTRY, "extra": 1}}, bytes(8)), "exactly the keys"),
        (_blob({"x": {**GOOD_ENTRY, "dtype": "F128"}}, bytes(8)), "unknown dtype"),
        (_blob({"x": {**GOOD_ENTRY, "dtype": 4}}, bytes(8)), "unknown dtype"),
        (_blob({"x": {**GOOD_ENTRY, "shape": 2}}, bytes(8)), "shape must be"),
        (_blob({"x": {**GOOD_ENTRY, "shape": [-2]}}, bytes(8)), "shape must be"),
        (_blob({"x": {**GOOD_ENTRY, "shape": [2.0]}}, bytes(8)), "shape must be"),
        (_blob({"x": {**GOOD_ENTRY, "shape": [True, 2]}}, bytes(8)), "shape must be"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [0]}}, bytes(8)), "two non-negative ints"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [0, 8, 8]}}, bytes(8)), "two non-negative ints"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [-8, 0]}}, bytes(8)), "two non-negative ints"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [False, 8]}}, bytes(8)), "two non-negative ints"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [8, 0]}}, bytes(8)), "before begin"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [0, 16]}}, bytes(8)), "past the 8-byte data section"),
        (_blob({"x": {**GOOD_ENTRY, "shape": [3]}}, bytes(8)), "needs 12 bytes"),
        (_blob({"x": {**GOOD_ENTRY, "shape": [2**62, 2**62]}}, bytes(8)), "more than 2**64 bytes"),
        (_blob({"x": GOOD_ENTRY}, bytes(12)), "data section holds 12"),
        (_blob({"x": GOOD_ENTRY}, bytes(4)), "past the 4-byte data section"),
        (_blob({"x": {**GOOD_ENTRY, "data_offsets": [4, 12]}}, bytes(12)), "a gap"),
        (
            _blob({"x": GOOD_ENTRY, "y": {**GOOD_ENTRY, "data_offsets": [4, 12]}}, bytes(12)),
            "an overlap",
        ),
        (
            _blob({"x": GOOD_ENTRY, "y": {**GOOD_ENTRY, "data_offsets": [0, 8]}}, bytes(16)),
            "an overlap",
        ),
    ],
)
def test_load_rejects_malformed_blob_with_a_precise_message(blob: bytes, message: str) -> None:
    with pytest.raises(WireFormatError, match=re.escape(message)):
        load_safetensors(blob)


def test_load_accepts_zero_size_tensors_sharing_an_offset() -> None:
    header = {
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "b": {"dtype": "U8", "shape": [2, 0], "data_offsets": [0, 0]},
        "c": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
    }
    tensors, _ = load_safetensors(_blob(header, b"hi"))
    assert tensors["c"].data == b"hi" and tensors["a"].data == b"" and tensors["b"].shape == (2, 0)


def test_wire_format_error_is_a_value_error() -> None:
    assert issubclass(WireFormatError, ValueError)


# -- fuzzing: arbitrary bytes only ever raise WireFormatError --------------------------------------


def _load_or_wire_error(blob: bytes) -> None:
    try:
        tensors, metadata = load_safetensors(blob)
    except WireFormatError:
        return
    # Whatever parses is self-consistent and survives a re-dump.
    again, meta_again = load_safetensors(dump_safetensors(list(tensors.values()), metadata))
    assert again == tensors and meta_again == metadata


VALID = dump_safetensors(
    [
        WireTensor("embedding", "bfloat16", (3, 4), bytes(range(24))),
        WireTensor("grid", "int64", (3,), struct.pack("<3q", 1, 2, 2)),
        WireTensor("empty", "float32", (0, 4), b""),
    ],
    {"fingerprint": "a" * 64, "mm_hash": "b" * 64, "format": "1"},
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_only_raise_wire_format_error(blob: bytes) -> None:
    _load_or_wire_error(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=2**64 - 1))
def test_fuzz_random_header_length_only_raises_wire_format_error(tail: bytes, n: int) -> None:
    _load_or_wire_error(n.to_bytes(8, "little") + tail)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(VALID)))
def test_fuzz_truncated_blob_only_raises_wire_format_error(cut: int) -> None:
    if cut == len(VALID):
        load_safetensors(VALID[:cut])
    else:
        with pytest.raises(WireFormatError):
            load_safetensors(VALID[:cut])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(0, 255)), max_size=6))
def test_fuzz_corrupted_bytes_only_raise_wire_format_error(edits: list[tuple[int, int]]) -> None:
    blob = bytearray(VALID)
    for pos, value in edits:
        blob[pos] = value
    _load_or_wire_error(bytes(blob))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=16,
)
entry_like = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "X"]) | json_values,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 40), min_size=0, max_size=3) | json_values,
    },
    optional={"extra": json_values},
)


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["__metadata__", "x", "y"]) | st.text(max_size=6), entry_like | json_values, max_size=4
    ),
    st.binary(max_size=40),
)
def test_fuzz_structured_headers_only_raise_wire_format_error(header: dict[str, object], data: bytes) -> None:
    _load_or_wire_error(_blob(header, data))
