"""``bench.tower_memory``'s Qwen2.5-Omni-7B case (its thinker, both towers): the config is transformers'
own ``Qwen2_5OmniThinkerConfig`` defaults (the 7B's) but where the 7B differs from them, and its
parameter counts are transformers' for the same config (built on the meta device: no memory), the
vision tower and merger and the audio encoder each; the KV bytes per token are the config's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from bench.tower_memory import (
    CASES,
    GIB,
    QWEN2_5_OMNI_7B,
    h200,
    kv_bytes_per_token,
    parameters,
    text_config,
    thinker_config,
)

VISION, AUDIO = 676_550_144, 639_647_232


def _thinker(raw: dict[str, Any]) -> Any:
    from transformers import Qwen2_5OmniThinkerConfig

    return Qwen2_5OmniThinkerConfig(**{k: v for k, v in thinker_config(raw).items() if k != "model_type"})


def _fields(config: Any) -> dict[str, Any]:
    skip = {"transformers_version", "layer_types", "_name_or_path"}
    return {k: v for k, v in config.to_dict().items()
            if k not in skip and (not isinstance(v, dict) or k == "rope_parameters")}


def test_the_config_is_transformers_defaults_but_where_the_7b_differs() -> None:
    """The sub-configs' defaults are the 7B's, but for the vision width (the class's 3584 is the language
    model's; the 7B's tower is 1280 wide), ``tokens_per_second`` (not a field: vLLM's fallback, 25), the
    language model's untied lm_head and the mrope sections."""
    mine, default = _thinker(QWEN2_5_OMNI_7B), _thinker({})
    differences = {}
    for sub in ("vision_config", "audio_config", "text_config"):
        a, b = _fields(getattr(mine, sub)), _fields(getattr(default, sub))
        differences.update({(sub, k): (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    assert differences == {
        ("vision_config", "hidden_size"): (1280, 3584),
        ("vision_config", "tokens_per_second"): (25, None),
        ("text_config", "tie_word_embeddings"): (False, True),
        ("text_config", "rope_parameters"): (
            {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            {"rope_type": "default", "rope_theta": 1000000.0},
        ),
    }
    assert mine.position_id_per_seconds == 25 and mine.tie_word_embeddings is False


@pytest.mark.parametrize("layers", [1, 28])
def test_qwen2_5_omni_counts_are_transformers_own(layers: int) -> None:
    """Both towers as vLLM names them (``visual``: the patch embedding, 32 blocks and the merger;
    ``audio_tower``: the convs, 32 layers, ln_post, proj and the bos/eos embeddings; its positions are
    a buffer, its average pool has no parameters), the 7B language model with untied embeddings."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    raw = json.loads(json.dumps(QWEN2_5_OMNI_7B))
    text_config(raw)["num_hidden_layers"] = layers
    with torch.device("meta"):
        model = Qwen2_5OmniThinkerForConditionalGeneration(_thinker(raw))
    unique = {id(p): (n, p.numel()) for n, p in model.named_parameters()}
    towers: dict[str, int] = {}
    for name, numel in unique.values():
        tower = next((t for t in ("visual", "audio_tower") if f".{t}." in f".{name}"), None)
        if tower:
            towers[tower] = towers.get(tower, 0) + numel
    counted = parameters(raw)
    assert counted["towers"] == towers == {"visual": VISION, "audio_tower": AUDIO}
    assert counted["tower"] == VISION + AUDIO
    assert counted["language"] + counted["tower"] == sum(numel for _, numel in unique.values())
    assert kv_bytes_per_token(raw) == 2 * layers * 4 * 128 * 2


def test_the_omni_case_and_its_whole_7b_arithmetic() -> None:
    case = CASES["qwen2_5_omni_7b"]
    assert case.tower_prefixes == ("visual", "audio_tower")
    assert case.tower_free_limits == {"image": 0, "video": 0, "audio": 0}
    assert kv_bytes_per_token(QWEN2_5_OMNI_7B) == 2 * 28 * 4 * 128 * 2 == 57_344
    figures = h200(QWEN2_5_OMNI_7B)
    assert figures["kv_tokens_bought"] == 2 * (VISION + AUDIO) // 57_344
    assert figures["tower_weight_bytes"] / GIB == pytest.approx(2.4518, abs=1e-3)
    assert 0 < figures["kv_gain_share"] < 0.05
