"""The client's store reader parses what the server stores, with the same refusals, on its own."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from encode_client.store import CorruptValue, parse_value

from encode_server.core.stored import encode_value
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.core.wire import from_numpy

FP, H = "a" * 64, "c" * 64
KEY = f"encode:v1:{FP}:{H}"
ROOT = Path(__file__).resolve().parents[2]


def value(dtype: str = "float32") -> tuple[np.ndarray, bytes]:
    x = np.linspace(-3, 3, 5 * 8, dtype=np.float32).reshape(5, 8)
    t = from_numpy("e", x, dtype=dtype)
    return x, encode_value(FP, H, Embedding(EncodedTensor(t.data, t.shape, t.dtype), {"image_grid_thw": [1, 2, 10]}))


def test_reads_the_server_value_float32_and_bfloat16() -> None:
    x, blob = value()
    emb = parse_value(KEY, blob, fingerprint=FP)
    np.testing.assert_array_equal(emb.numpy(), x)
    assert (emb.shape, emb.dtype, emb.meta, emb.mm_hash) == ((5, 8), "float32", {"image_grid_thw": [1, 2, 10]}, H)
    _, bf = value("bfloat16")
    widened = parse_value(KEY, bf).numpy()
    assert widened.dtype == np.float32
    np.testing.assert_allclose(widened, x, rtol=1 / 128)


@pytest.mark.parametrize(
    "case",
    ["truncated", "random", "other_key", "other_fingerprint_expected", "extra_bytes"],
)
def test_refuses_what_the_server_refuses(case: str) -> None:
    _, blob = value()
    bad = {
        "truncated": (KEY, blob[:-4], None),
        "random": (KEY, np.random.default_rng(1).bytes(len(blob)), None),
        "other_key": (f"encode:v1:{FP}:{'d' * 64}", blob, None),
        "other_fingerprint_expected": (KEY, blob, "b" * 64),
        "extra_bytes": (KEY, blob + b"\0\0\0\0", None),
    }[case]
    with pytest.raises(CorruptValue):
        parse_value(bad[0], bad[1], fingerprint=bad[2])


def test_redis_is_imported_only_by_the_redis_tier_and_the_store_reader() -> None:
    importing = {
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("encode_server/**/*.py"), *ROOT.glob("clients/python/encode_client/**/*.py")]
        if re.search(r"^\s*(import redis|from redis)", p.read_text(), re.M)
    }
    assert importing == {"encode_server/cache/redis.py", "clients/python/encode_client/store.py"}
