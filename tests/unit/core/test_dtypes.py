"""``auto_dtype``: vLLM 0.32's ``--dtype auto`` over dtype names (tests/vllm/test_dtype.py checks
it against vLLM's own function for every platform list)."""

from __future__ import annotations

import pytest

from encode_server.core.dtypes import auto_dtype, normalize_dtype, widest_dtype

AMPERE = ["bfloat16", "float16", "float32"]  # also the x86 and ARM CPUs
TURING = ["float16", "float32"]
KEPLER = ["float32"]
POWER = ["bfloat16", "float32", "float16"]


@pytest.mark.parametrize(
    ("checkpoint", "model_type", "supported", "power", "expected"),
    [
        ("bfloat16", "qwen2_5_vl", AMPERE, False, "bfloat16"),  # the case: bf16 stays bf16 on this CPU
        ("float16", "qwen2_5_vl", AMPERE, False, "float16"),
        ("float32", "qwen2_5_vl", AMPERE, False, "bfloat16"),  # a float32 checkpoint is downcast to the preferred
        (None, "qwen2_5_vl", AMPERE, False, "bfloat16"),  # no dtype anywhere: float32, then as above
        ("bfloat16", "qwen2_5_vl", TURING, False, "float16"),  # no bf16 on the device: the preferred
        ("float32", "qwen2_5_vl", TURING, False, "float16"),
        ("bfloat16", "qwen2_5_vl", KEPLER, False, "float32"),
        ("float16", "gemma3", AMPERE, False, "bfloat16"),  # vLLM never runs gemma3 in float16
        ("float16", "gemma3", TURING, False, "float32"),
        ("float16", "qwen2_5_vl", POWER, True, "bfloat16"),  # POWER CPUs: bf16 whatever the checkpoint
        ("float32", "qwen2_5_vl", POWER, True, "bfloat16"),
        ("float64", "qwen2_5_vl", AMPERE, False, "bfloat16"),  # unsupported: the preferred
    ],
)
def test_auto_follows_vllm(
    checkpoint: str | None, model_type: str, supported: list[str], power: bool, expected: str
) -> None:
    assert auto_dtype(checkpoint, model_type, supported, power_cpu=power) == expected


def test_config_spellings_and_weight_dtypes() -> None:
    assert [normalize_dtype(v) for v in ("bfloat16", "torch.float16", "half", "float", None)] == [
        "bfloat16", "float16", "float16", "float32", None,
    ]
    assert widest_dtype(["BF16", "BF16", "I64"]) == "bfloat16"
    assert widest_dtype(["BF16", "F32"]) == "float32"
    assert widest_dtype(["I64"]) is None


def test_no_usable_dtype_is_an_error() -> None:
    with pytest.raises(ValueError, match="no dtype"):
        auto_dtype("float16", "gemma3", ["float16"])
