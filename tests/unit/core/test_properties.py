"""Property tests (hypothesis) beside the example tests: the wire format and the stored value
round trip for every dtype and shape; their parsers raise nothing but their own error on any
bytes; cache keys never collide; the batcher answers every item exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import struct

import pytest
from encode_client.store import CorruptValue as ClientCorruptValue
from encode_client.store import parse_value
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from encode_server.core.batcher import Batcher
from encode_server.core.hashing import cache_key
from encode_server.core.stored import CorruptValue, ValueSpec, decode_value, encode_value
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.core.wire import DTYPES, WireFormatError, WireTensor, dump_safetensors, load_safetensors

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
names = st.text(min_size=0, max_size=12).filter(lambda s: s != "__metadata__")
meta_strings = st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4)


@st.composite
def wire_tensors(draw: st.DrawFn) -> list[WireTensor]:
    chosen = draw(st.lists(names, max_size=4, unique=True))
    out = []
    for name in chosen:
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(shapes)
        data = draw(st.binary(min_size=math.prod(shape) * DTYPES[dtype].itemsize,
                              max_size=math.prod(shape) * DTYPES[dtype].itemsize))
        out.append(WireTensor(name, dtype, shape, data))
    return out


@FAST
@given(wire_tensors(), st.none() | meta_strings)
def test_safetensors_round_trip_any_dtype_shape_and_metadata(tensors: list[WireTensor], metadata: dict | None) -> None:
    blob = dump_safetensors(tensors, metadata)
    loaded, meta = load_safetensors(blob)
    assert meta == (metadata or {})
    assert {t.name: t for t in tensors} == loaded


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_load_safetensors_on_any_bytes_raises_only_its_own_error(blob: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        load_safetensors(blob)


def _header_blob(header: object, tail: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + tail


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.binary(max_size=64))
def test_load_safetensors_on_any_json_header_raises_only_its_own_error(header: object, tail: bytes) -> None:
    """Headers that are valid JSON but anything but a valid layout: still only WireFormatError."""
    with contextlib.suppress(WireFormatError):
        load_safetensors(_header_blob(header, tail))


# -- the stored Redis value ------------------------------------------------------------------------

FP = "f" * 64
stored_dtypes = st.sampled_from(["float32", "bfloat16", "float16"])
metas = st.dictionaries(st.text(max_size=8), st.integers() | st.lists(st.integers(0, 64), max_size=3), max_size=3)


@FAST
@given(stored_dtypes, st.integers(1, 6), st.integers(1, 5), hex64, metas, st.randoms(use_true_random=False))
def test_stored_value_round_trips_and_the_client_reads_it_alike(
    dtype: str, n: int, d: int, mm: str, meta: dict, rng: random.Random
) -> None:
    data = rng.randbytes(n * d * DTYPES[dtype].itemsize)
    value = Embedding(EncodedTensor(data, (n, d), dtype), meta)
    blob = encode_value(FP, mm, value)
    assert decode_value(blob, ValueSpec(FP, dtype, d), mm) == value
    key = f"encode:v1:{FP}:{mm}"
    read = parse_value(key, blob, fingerprint=FP)
    assert (read.data, read.shape, read.dtype, read.meta) == (data, (n, d), dtype, meta)


def _stored_blob() -> bytes:
    return encode_value(FP, "a" * 64, Embedding(EncodedTensor(b"\x00" * 16, (2, 2), "float32"), {"g": [1, 2]}))


VALID_VALUE = _stored_blob()


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.binary(max_size=300),
    st.lists(st.tuples(st.integers(0, len(VALID_VALUE) - 1), st.integers(0, 255)), min_size=1, max_size=5).map(
        lambda edits: _edit(VALID_VALUE, edits)),
    st.integers(0, len(VALID_VALUE) - 1).map(lambda cut: VALID_VALUE[:cut]),
))
def test_stored_value_parsers_on_any_bytes_raise_only_their_own_error(blob: bytes) -> None:
    spec = ValueSpec(FP, "float32", 2)
    with contextlib.suppress(CorruptValue):
        decode_value(blob, spec, "a" * 64)
    with contextlib.suppress(ClientCorruptValue):
        parse_value(f"encode:v1:{FP}:{'a' * 64}", blob, fingerprint=FP)


def _edit(blob: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(blob)
    for at, byte in edits:
        out[at] = byte
    return bytes(out)


@pytest.mark.parametrize("field", ["shape", "meta"])
def test_deeply_nested_json_in_stored_metadata_is_corrupt_not_a_crash(field: str) -> None:
    """``json.loads`` raises RecursionError (not a ValueError) past ~1000 levels: still corrupt."""
    header = json.loads(VALID_VALUE[8 : 8 + struct.unpack("<Q", VALID_VALUE[:8])[0]])
    header["__metadata__"][field] = "[" * 100_000 + "]" * 100_000
    blob = _header_blob(header, VALID_VALUE[8 + struct.unpack("<Q", VALID_VALUE[:8])[0]:])
    with pytest.raises(CorruptValue):
        decode_value(blob, ValueSpec(FP, "float32", 2), "a" * 64)
    with pytest.raises(ClientCorruptValue):
        parse_value(f"encode:v1:{FP}:{'a' * 64}", blob, fingerprint=FP)


# -- key framing -----------------------------------------------------------------------------------

prefixes = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
tenants = st.none() | st.text(min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.tuples(prefixes, hex64, hex64, tenants), st.tuples(prefixes, hex64, hex64, tenants))
def test_distinct_key_inputs_never_give_one_key(a: tuple, b: tuple) -> None:
    """Prefixes may hold ``:``; fingerprints, tenants and hashes still can't shift into each other."""
    assume(a != b)
    ka = cache_key(a[1], a[2], prefix=a[0], tenant=a[3])
    kb = cache_key(b[1], b[2], prefix=b[0], tenant=b[3])
    assert ka != kb


@settings(max_examples=200, deadline=None)
@given(prefixes, hex64, hex64, tenants, tenants)
def test_one_key_input_differing_only_in_tenant_never_collides(p: str, fp: str, mm: str, t1, t2) -> None:
    assume(t1 != t2)
    assert cache_key(fp, mm, prefix=p, tenant=t1) != cache_key(fp, mm, prefix=p, tenant=t2)


@settings(max_examples=100, deadline=None)
@given(prefixes, hex64, hex64, st.text(":", min_size=1, max_size=3) | st.just("t"))
def test_tenant_ids_that_look_like_key_segments_cannot_forge_another_key(p: str, fp: str, mm: str, t: str) -> None:
    assert cache_key(fp, mm, prefix=p, tenant=t) != cache_key(fp, mm, prefix=p)
    assert cache_key(fp, mm, prefix=p, tenant=t).rsplit(":", 1)[1] == mm


# -- the batcher -----------------------------------------------------------------------------------

arrivals = st.lists(
    st.tuples(
        st.integers(0, 3),  # wait before this item, in ms
        st.integers(1, 300),  # token cost (some above max_batch_tokens=256)
        st.booleans(),  # cancel it right away (a client that went away)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40, deadline=None)
@given(arrivals, st.integers(1, 8), st.integers(0, 4))
def test_batcher_answers_every_item_exactly_once_in_bounded_time(
    pattern: list[tuple[int, int, bool]], max_size: int, wait_ms: int
) -> None:
    batches: list[list[tuple[int, int]]] = []

    def run(items: list[tuple[int, int]]) -> list[int]:
        batches.append(list(items))
        return [i * 10 for i, _cost in items]

    async def scenario() -> None:
        b: Batcher[tuple[int, int], int] = Batcher(
            run, max_batch_size=max_size, max_batch_tokens=256, max_wait_s=wait_ms / 1000
        )
        b.start()
        futures: dict[int, asyncio.Future[int]] = {}
        cancelled = set()
        for i, (sleep_ms, cost, cancel) in enumerate(pattern):
            if sleep_ms:
                await asyncio.sleep(sleep_ms / 1000)
            futures[i] = b.submit((i, cost), cost)
            if cancel:
                futures[i].cancel()
                cancelled.add(i)
        _done, pending = await asyncio.wait(futures.values(), timeout=5)
        assert not pending, "an item was never answered"
        await asyncio.wait_for(b.close(), 5)
        for i, f in futures.items():
            if i in cancelled:
                assert f.cancelled()
            else:
                assert f.result() == i * 10
        ran = [i for batch in batches for i, _ in batch]
        assert len(ran) == len(set(ran)), "an item ran twice"
        assert set(futures) - cancelled <= set(ran), "an answered item never ran"
        assert ran == sorted(ran), "FIFO order broken"
        for batch in batches:
            assert 1 <= len(batch) <= max_size
            assert len(batch) == 1 or sum(c for _, c in batch) <= 256
        assert b.pending == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))  # a hang is a failure, not a stuck suite
