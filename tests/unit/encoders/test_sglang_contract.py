"""Which families SGLang's language-only prefill takes from encode-server, as each family declares it
(``Family.sglang``), and that a family it does not take stops a ``--sglang`` start with a reason."""

from __future__ import annotations

import pytest

from encode_server.app import sglang_contract
from encode_server.core.sglang_wire import CURRENT
from encode_server.core.types import VideoInfo
from encode_server.encoders import FAMILIES, load_encoder
from tests.images import rgb_image

# SGLang 0.5.23's encoder-disaggregation allow-list (arg_groups/pd_disaggregation_hook.py), the part of
# it encode-server has families for and SGLang has a model for: Qwen2-Audio is on it, but its meta has
# no mel-frame count; Qwen2.5-Omni is on it by name, but SGLang has no model or processor for it.
SGLANG_TAKES = {"qwen2_vl", "qwen3_vl", "qwen3_omni", "kimi_k25"}


def test_the_families_sglang_takes_declare_how() -> None:
    assert {f.name for f in FAMILIES if f.sglang is not None} == SGLANG_TAKES


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.sglang is not None], ids=lambda f: f.name)
def test_a_contract_names_only_the_familys_modalities_and_extras_sglang_reads(family: object) -> None:
    contract = family.sglang  # type: ignore[attr-defined]
    assert set(contract.modalities) <= set(family.modalities)  # type: ignore[attr-defined]
    assert set(contract.extras) <= set(contract.modalities)
    assert {e.attr for extras in contract.extras.values() for e in extras} <= set(CURRENT.extras)
    assert contract.architectures


def test_the_builtin_models_meta_has_the_grids_its_contract_names() -> None:
    encoder = load_encoder("builtin:tiny")
    contract = sglang_contract(encoder)
    assert contract.grids["image"] in encoder.preprocess(rgb_image()).meta
    plan = encoder.plan_video(VideoInfo(64, 48, 8, 4.0, "h264"), 2.0)
    assert contract.grids["video"] in plan.meta and "second_per_grid_ts" in plan.meta


def test_a_family_sglang_does_not_take_stops_the_start() -> None:
    encoder = load_encoder("builtin:tiny")
    encoder.family = next(f for f in FAMILIES if f.name == "clip")
    with pytest.raises(ValueError, match="not a family SGLang's language-only prefill takes") as refused:
        sglang_contract(encoder)
    assert "qwen2_vl" in str(refused.value)
