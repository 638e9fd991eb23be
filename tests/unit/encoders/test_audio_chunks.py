"""The Omni thinkers' audio towers: one attention call per layer, no host sync, the loop's rows
exactly (``audio_chunks.py``)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch

from bench.tower_ops import count, device_counts
from encode_server.encoders import load_encoder
from encode_server.encoders.varlen import ATTENTION, layout_of
from tests.unit.encoders.util import decode

# a short one, exactly 30 s, one past it: chunks (or attention windows) of several lengths in one pass
SECONDS = (3, 30, 41)
KINDS = ("qwen2_5_omni", "qwen3_omni_moe")


def _encoder(kind: str, request: pytest.FixtureRequest) -> Any:
    return load_encoder(str(request.getfixturevalue(f"{kind}_dir")), device="cpu", dtype="float32")


def _batch(encoder: Any) -> list[Any]:
    rng = np.random.default_rng(0)
    return [encoder.preprocess_audio((0.1 * rng.standard_normal(s * 16_000)).astype(np.float32), 16_000)
            for s in SECONDS]


def _features(batch: list[Any]) -> list[torch.Tensor]:
    return [item.inputs["input_features"] for item in batch]


def _tower_computes(encoder: Any, features: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the tower's forward computes for the pass when handed nothing: its module's helpers,
    called as its forward calls them."""
    tower = encoder.audio_tower
    helpers = sys.modules[type(tower).__module__]
    lengths = torch.tensor([f.shape[-1] for f in features])
    padded, chunks = helpers.chunk_and_pad_features(torch.cat(features, dim=-1), lengths, tower.n_window)
    out = {"padded_feature": padded, "chunk_lengths": chunks}
    if encoder.info.kind == "qwen2_5_omni":
        out |= {"valid_indices": helpers.get_valid_indices(chunks), "pool_indices": helpers.get_pool_indices(lengths),
                "cu_seqlens": helpers.get_audio_cu_seqlens(chunks)}
    else:
        out |= {"valid_indices": helpers.get_valid_indices(chunks, tower.n_window),
                "cu_seqlens": helpers.get_audio_cu_seqlens(chunks, lengths, tower.n_window_infer, tower.n_window)}
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_plan_is_what_the_tower_computes_for_the_whole_pass(kind: str, request: pytest.FixtureRequest) -> None:
    encoder = _encoder(kind, request)
    assert encoder.audio_plan.supported
    features = _features(_batch(encoder))
    made = encoder.audio_plan.inputs(features, torch.device("cpu"), torch.float32)
    expected = _tower_computes(encoder, features)
    assert set(made.kwargs) == {*expected, "max_seqlen"}
    for key, tensor in expected.items():
        assert torch.equal(made.kwargs[key], tensor), key
    cu = made.kwargs["cu_seqlens"]
    assert made.kwargs["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert set(made.layouts) == {id(cu)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_pass_of_3_30_and_41_s_gives_the_loops_rows_in_one_call_per_length_per_layer(
        kind: str, request: pytest.FixtureRequest) -> None:
    """Against the tower as transformers runs it: its own layout computations and its sdpa loop,
    one call per segment; bit for bit in float32."""
    encoder = _encoder(kind, request)
    tower = encoder.audio_tower
    assert tower.config._attn_implementation == ATTENTION
    batch = _batch(encoder)
    encoder.forward(batch)  # warm: the plan of these frame counts made
    new, counts = count(lambda: encoder.forward(batch))
    cu = encoder.audio_plan.inputs(_features(batch), torch.device("cpu"), torch.float32).kwargs["cu_seqlens"]
    lengths = len(layout_of(cu).groups)
    assert lengths > 1  # the pass has chunks (or windows) of more than one length
    assert counts.attention_calls == len(tower.layers) * lengths and counts.syncs == 0
    tower.config._attn_implementation_internal = "sdpa"
    encoder.audio_plan.supported = False
    old, counts = count(lambda: encoder.forward(batch))
    assert counts.syncs > 0 and counts.attention_calls > len(tower.layers) * lengths
    for item, a, b in zip(batch, new, old, strict=True):
        assert decode(a).shape[0] == item.num_tokens
        assert torch.equal(decode(a), decode(b))


@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_path_makes_one_attention_call_per_layer_and_no_sync(kind: str, request: pytest.FixtureRequest) -> None:
    """Counted on the meta device, where the attention takes the ``varlen_attn`` kernel's path."""
    encoder = _encoder(kind, request)
    counts = device_counts(encoder, _batch(encoder))
    assert counts["attention_calls"] == len(encoder.audio_tower.layers)
    assert counts["syncs"] == 0
