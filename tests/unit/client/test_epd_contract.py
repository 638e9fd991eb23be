"""The EPD contract the rewrite follows, read from ``GET /v1/model``'s ``family.epd`` (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from encode_client.epd import EpdContract, EpdContractError

QWEN = {"id": "q", "family": {"name": "qwen2_vl", "modalities": ["image"],
                              "epd": {"mode": "pixel_free", "fields": {"image": ["image_grid_thw"]}}}}
INTERNVL = {"id": "i", "family": {"name": "internvl", "modalities": ["image"],
                                  "epd": {"mode": "pixels_uuid", "fields": {}, "vllm_model": "interns1.py"}}}


def test_both_modes_are_read_with_their_fields() -> None:
    assert EpdContract.from_model(QWEN) == EpdContract("pixel_free", {"image": ("image_grid_thw",)})
    assert EpdContract.from_model(INTERNVL) == EpdContract("pixels_uuid", {})


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ({"id": "old"}, "names no model family"),
        ({"id": "clip", "family": {"name": "clip", "epd": None}}, "no vLLM prefill consumes"),
        ({"family": {"name": "x", "epd": {"mode": "tower"}}}, "not one this client knows"),
        ({"family": {"name": "x", "epd": {"mode": "pixel_free", "fields": {}}}}, "names no image fields"),
    ],
)
def test_a_model_without_a_usable_contract_is_a_deployment_error(model: dict[str, Any], words: str) -> None:
    with pytest.raises(EpdContractError, match=words):
        EpdContract.from_model(model)


def test_tensor_fields_are_read_and_an_older_server_has_none() -> None:
    epd = {"mode": "pixel_free", "fields": {"image": ["image_grid_thw"], "video": ["video_grid_thw"]},
           "tensors": {"video": {"second_per_grid_ts": "float32"}}}
    contract = EpdContract.from_model({"family": {"name": "qwen2_vl", "epd": epd}})
    assert contract.tensors == {"video": {"second_per_grid_ts": "float32"}}
    assert contract.fields["video"] == ("video_grid_thw",)
    assert EpdContract.from_model(QWEN).tensors == {}


@pytest.mark.parametrize("tensors", [["second_per_grid_ts"], {"video": {"second_per_grid_ts": "bfloat16"}},
                                     {"video": ["second_per_grid_ts"]}])
def test_tensor_fields_this_client_cannot_write_are_a_deployment_error(tensors: Any) -> None:
    epd = {"mode": "pixel_free", "fields": {"image": ["image_grid_thw"]}, "tensors": tensors}
    with pytest.raises(EpdContractError, match="tensor fields this client cannot write"):
        EpdContract.from_model({"family": {"name": "x", "epd": epd}})
