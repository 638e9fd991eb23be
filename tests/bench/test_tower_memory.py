"""``bench.tower_memory``'s arithmetic, which turns the measured run into the whole model's figures:
its parameter counts are transformers' own for the same config (built on the meta device, no
memory), and the KV bytes per token are the config's."""

from __future__ import annotations

import json

import pytest
import torch

from bench.tower_memory import GIB, QWEN2_5_VL_3B, QWEN2_AUDIO_7B, h200, kv_bytes_per_token, parameters


@pytest.mark.parametrize("layers", [1, 36])
def test_parameter_counts_are_transformers_own(layers: int) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    raw = json.loads(json.dumps(QWEN2_5_VL_3B))
    raw["num_hidden_layers"] = layers
    config = Qwen2_5_VLConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    unique = {id(p): (n, p.numel()) for n, p in model.named_parameters()}
    tower = sum(numel for n, numel in unique.values() if ".visual." in f".{n}")
    total = sum(numel for _, numel in unique.values())
    counted = parameters(raw)
    assert counted["tower"] == tower == 668_684_288
    assert counted["language"] + counted["tower"] == total


def test_kv_arithmetic_for_the_whole_3b() -> None:
    assert kv_bytes_per_token(QWEN2_5_VL_3B) == 2 * 36 * 2 * 128 * 2 == 36_864
    figures = h200(QWEN2_5_VL_3B)
    assert figures["budget_bytes"] == pytest.approx(0.9 * 143_771 * (1 << 20))
    assert figures["kv_tokens_bought"] == 2 * 668_684_288 // 36_864
    assert 0 < figures["kv_gain_share"] < 0.05
    assert figures["tower_weight_bytes"] / GIB == pytest.approx(1.2456, abs=1e-3)


@pytest.mark.parametrize("layers", [1, 32])
def test_qwen2_audio_counts_are_transformers_own(layers: int) -> None:
    """The audio case: Whisper-large's encoder and the projector (637.0 M and 5.2 M, as docs/epd-families.md
    counts them), the 7B language model with untied embeddings."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    raw = json.loads(json.dumps(QWEN2_AUDIO_7B))
    raw["text_config"]["num_hidden_layers"] = layers
    config = Qwen2AudioConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = Qwen2AudioForConditionalGeneration(config)
    unique = {id(p): (n, p.numel()) for n, p in model.named_parameters()}
    parts = (".audio_tower.", ".multi_modal_projector.")
    tower = sum(numel for n, numel in unique.values() if any(part in f".{n}" for part in parts))
    total = sum(numel for _, numel in unique.values())
    counted = parameters(raw)
    assert counted["tower"] == tower == 636_968_960 + 5_246_976
    assert counted["language"] + counted["tower"] == total
    assert kv_bytes_per_token(raw) == 2 * layers * 32 * 128 * 2
