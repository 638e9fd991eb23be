"""``parse_fetch_answer``: encode-server's hash-only answer is checked like a stored value, so a
prefill worker never uses numbers that are not the asked image's under the asked model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from encode_client.fetch import parse_fetch_answer
from encode_client.safetensors import dump_safetensors, from_numpy
from encode_client.store import CorruptValue, StoredEmbedding

FP = "f" * 64
H1, H2 = "1" * 64, "2" * 64
KEYS = [f"encode:v1:{FP}:{H1}", f"encode:v1:{FP}:{H2}"]


def _answer(items: list[dict], tensors: dict[str, np.ndarray], fingerprint: str = FP) -> bytes:
    wire = [from_numpy(name, array) for name, array in tensors.items()]
    return dump_safetensors(wire, {"model": "m", "fingerprint": fingerprint, "items": json.dumps(items)})


def _item(index: int, h: str, rows: int = 3, status: str = "hit") -> dict:
    if status == "miss":
        return {"index": index, "hash": h, "status": "miss", "source": None}
    return {"index": index, "hash": h, "status": status, "source": "local", "num_tokens": rows,
            "shape": [rows, 4], "dtype": "float32", "meta": {"image_grid_thw": [1, 2, 6]}}


def test_a_good_answer_gives_each_items_embedding_and_misses_as_none() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = parse_fetch_answer(_answer([_item(0, H1), _item(1, H2, status="miss")], {"0": x}), KEYS, [H1, H2], FP)
    assert isinstance(out[0], StoredEmbedding) and out[1] is None
    assert out[0].key == KEYS[0] and out[0].mm_hash == H1 and out[0].fingerprint == FP
    assert np.array_equal(out[0].numpy(), x) and out[0].meta == {"image_grid_thw": [1, 2, 6]}


@pytest.mark.parametrize(
    "blob",
    [
        b"not safetensors",
        _answer([_item(0, H2), _item(1, H1)], {"0": np.zeros((3, 4), np.float32), "1": np.zeros((3, 4), np.float32)}),
        _answer([_item(0, H1)], {"0": np.zeros((3, 4), np.float32)}),
        _answer([_item(0, H1), _item(1, H2)], {"0": np.zeros((3, 4), np.float32), "1": np.zeros((3, 4), np.float32)},
                fingerprint="e" * 64),
    ],
    ids=["not-safetensors", "other-hashes", "fewer-items", "other-fingerprint"],
)
def test_an_answer_that_is_not_for_what_was_asked_is_corrupt_for_every_item(blob: bytes) -> None:
    out = parse_fetch_answer(blob, KEYS, [H1, H2], FP)
    assert all(isinstance(o, CorruptValue) for o in out), out


def test_an_item_whose_tensor_disagrees_with_its_description_is_corrupt_alone() -> None:
    good = np.ones((3, 4), np.float32)
    items = [_item(0, H1, rows=2), _item(1, H2)]  # item 0 says 2 rows, its tensor has 3
    out = parse_fetch_answer(_answer(items, {"0": good, "1": good}), KEYS, [H1, H2], FP)
    assert isinstance(out[0], CorruptValue) and isinstance(out[1], StoredEmbedding)
    out = parse_fetch_answer(_answer([_item(0, H1), _item(1, H2)], {"1": good}), KEYS, [H1, H2], FP)
    assert isinstance(out[0], CorruptValue), "a resolved item without its tensor"
