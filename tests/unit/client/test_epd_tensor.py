"""Tensor strings for an embeddings part's undeclared keys (``encode_client.epd_tensor``), read back
as vLLM 0.32 reads a string value (``VideoEmbeddingMediaIO.load_bytes``: base64, ``.npy`` magic,
``np.load``, ``torch.from_numpy``), with this environment's torch."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from encode_client.epd_tensor import tensor_string


def vllm_load(text: str) -> torch.Tensor:
    """What vLLM's loader does with the string (its .npy branch; np.load refuses pickles)."""
    data = base64.b64decode(text, validate=True)
    assert data[:6] == b"\x93NUMPY", "vLLM would torch.load it instead"
    with io.BytesIO(data) as buffer:
        return torch.from_numpy(np.load(buffer))


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        (1.25, "float32", torch.tensor(1.25, dtype=torch.float32)),
        (7 / 6, "float32", torch.tensor(7 / 6, dtype=torch.float32)),  # rounded as torch rounds it
        (7 / 6, "float64", torch.tensor(7 / 6, dtype=torch.float64)),
        ([0.5, 1.5, 2.5], "float64", torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)),
        ([1.0, 2], "float32", torch.tensor([1.0, 2.0], dtype=torch.float32)),
        ([2, 4, -(2**63)], "int64", torch.tensor([2, 4, -(2**63)], dtype=torch.int64)),
        ([], "int64", torch.tensor([], dtype=torch.int64)),
    ],
)
def test_a_tensor_string_loads_as_the_same_tensor(value: Any, dtype: str, expected: torch.Tensor) -> None:
    loaded = vllm_load(tensor_string(value, dtype))
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    assert torch.equal(loaded, expected)
    assert loaded.item() == expected.item() if expected.ndim == 0 else True


@pytest.mark.parametrize(
    ("value", "dtype", "words"),
    [
        (1.0, "bfloat16", "dtype must be one of"),
        (1.0, "float16", "dtype must be one of"),
        (float("nan"), "float32", "finite numbers only"),
        ([1.0, float("inf")], "float64", "finite numbers only"),
        ([[1, 2]], "int64", "finite numbers only"),
        ("1.0", "float32", "finite numbers only"),
        (True, "int64", "finite numbers only"),
        ({"a": 1}, "float32", "finite numbers only"),
        (1.5, "int64", "64-bit integers only"),
        (2**63, "int64", "64-bit integers only"),
    ],
)
def test_anything_else_is_refused(value: Any, dtype: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        tensor_string(value, dtype)


def test_every_contract_a_family_publishes_is_one_the_client_can_write() -> None:
    """Every family's published tensor fields read back as the same contract, each in a dtype this
    client writes."""
    from encode_client.epd import EpdContract

    from encode_server.encoders import FAMILIES

    for family in FAMILIES:
        if family.epd is not None:
            contract = EpdContract.from_model({"family": family.describe()})
            assert contract.tensors == family.epd.describe()["tensors"], family.name
            for named in contract.tensors.values():
                for dtype in named.values():
                    tensor_string([1.0], dtype)
