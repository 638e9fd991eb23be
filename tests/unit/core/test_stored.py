"""The shared-tier value: a round trip, and every way a stored value can be wrong is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from encode_server.core.stored import CorruptValue, ValueSpec, decode_value, encode_value
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.core.wire import WireTensor, dump_safetensors, from_numpy, load_safetensors

FP, OTHER_FP = "a" * 64, "b" * 64
H = "c" * 64
SPEC = ValueSpec(FP, "float32", 8)


def embedding(rows: int = 3, dim: int = 8, dtype: str = "float32") -> Embedding:
    t = from_numpy("x", np.arange(rows * dim, dtype=np.float32).reshape(rows, dim), dtype=dtype)
    return Embedding(EncodedTensor(t.data, t.shape, t.dtype), {"image_grid_thw": [1, 2, 6]})


def reencoded(blob: bytes, *, tensor: WireTensor | None = None, **changes: str) -> bytes:
    tensors, metadata = load_safetensors(blob)
    return dump_safetensors([tensor or tensors["embedding"]], {**metadata, **changes})


def test_round_trip_keeps_bytes_shape_dtype_and_meta() -> None:
    value = embedding()
    assert decode_value(encode_value(FP, H, value), SPEC, H) == value
    bf16 = embedding(dtype="bfloat16")
    assert decode_value(encode_value(FP, H, bf16), ValueSpec(FP, "bfloat16", 8), H) == bf16


def test_a_modalitys_own_width_is_taken_and_no_other() -> None:
    """Qwen3-Omni's audio rows (the language model's width) beside its wider DeepStack vision rows:
    a spec with that width takes both; a width neither names is refused."""
    omni = ValueSpec(FP, "float32", 8, frozenset({4}))
    narrow = embedding(dim=4)
    assert decode_value(encode_value(FP, H, narrow), omni, H) == narrow
    assert decode_value(encode_value(FP, H, embedding()), omni, H) == embedding()
    with pytest.raises(CorruptValue, match="expected \\[N >= 1, 4 or 8\\]"):
        decode_value(encode_value(FP, H, embedding(dim=6)), omni, H)
    with pytest.raises(CorruptValue, match="expected \\[N >= 1, 8\\]"):
        decode_value(encode_value(FP, H, narrow), SPEC, H)


def test_the_blob_is_plain_safetensors_with_documented_metadata() -> None:
    tensors, metadata = load_safetensors(encode_value(FP, H, embedding()))
    assert list(tensors) == ["embedding"]
    assert metadata["format"] == "encode-server/embedding/v1"
    assert (metadata["fingerprint"], metadata["mm_hash"], metadata["dtype"]) == (FP, H, "float32")
    assert json.loads(metadata["shape"]) == [3, 8]
    assert json.loads(metadata["meta"]) == {"image_grid_thw": [1, 2, 6]}


def bad_values() -> dict[str, bytes]:
    good = encode_value(FP, H, embedding())
    wide = from_numpy("embedding", np.zeros((3, 9), dtype=np.float32))
    return {
        "truncated": good[: len(good) - 5],
        "random_bytes": np.random.default_rng(0).bytes(len(good)),
        "empty": b"",
        "another_fingerprint": encode_value(OTHER_FP, H, embedding()),
        "another_mm_hash": encode_value(FP, "d" * 64, embedding()),
        "wrong_dtype": encode_value(FP, H, embedding(dtype="bfloat16")),
        "wrong_hidden_size": encode_value(FP, H, embedding(dim=9)),
        "shape_metadata_disagrees": reencoded(good, shape="[4,8]"),
        "tensor_reshaped_under_same_metadata": reencoded(good, tensor=wide),
        "other_format_version": reencoded(good, format="encode-server/embedding/v0"),
        "meta_not_json": reencoded(good, meta="{"),
        "no_metadata": dump_safetensors([load_safetensors(good)[0]["embedding"]]),
    }


@pytest.mark.parametrize("case", sorted(bad_values()))
def test_a_wrong_value_is_refused_never_served(case: str) -> None:
    with pytest.raises(CorruptValue):
        decode_value(bad_values()[case], SPEC, H)
