"""The EPD contract the rewrite follows, read from ``GET /v1/model``'s ``family.epd``, and what it
requires of an item (pure)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import Result, mm_hash
from encode_client.epd import EpdContract, EpdContractError, EPDError, apply_results, check_chat_request
from encode_client.keys import tenant_digest

from encode_server.core.hashing import cache_key

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
        ({"family": {"name": "x", "epd": {"mode": "pixel_free", "fields": {}}}}, "names no fields"),
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


# -- what an item's meta must hold is what the contract names, nothing more (issue 29) --

PNG = b"\x89PNG\r\n\x1a\n not decoded here"
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
FP = "cd" * 32


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "t"}]}]}


def _answer(status: str, meta: dict[str, Any], tenant: str | None = None) -> Result:
    """encode-server's hand-off answer for PNG (its store key included)."""
    h = mm_hash(PNG)
    return Result(0, h, status, None, 16, (), None, meta=meta, key=cache_key(FP, h, prefix="encode", tenant=tenant))


@pytest.mark.parametrize("status", ["encoded", "hit"])
@pytest.mark.parametrize(
    ("part", "kept"),
    [({"type": "image_url", "image_url": {"url": PNG_URL}}, {"image_url": {"url": PNG_URL}}),
     ({"type": "input_image", "image_url": PNG_URL}, {"image_url": PNG_URL})],
)
def test_a_pixels_and_uuid_item_without_metadata_keeps_its_image_and_takes_the_servers_identifier(
    status: str, part: dict[str, Any], kept: dict[str, Any]
) -> None:
    """Gemma 3's and LLaVA-1.5's items (a fixed row count, no grid) have ``meta == {}``: their
    contract names no fields, so nothing is missing; the identifier is the server's key's."""
    contract = EpdContract.from_model(INTERNVL)
    plan = check_chat_request(_chat(part))
    out = apply_results(_chat(part), plan, [_answer(status, {})], contract)
    assert out["messages"][0]["content"][0] == {"type": part["type"], **kept, "uuid": mm_hash(PNG)}
    tenant = apply_results(_chat(part), plan, [_answer(status, {}, tenant="acme")], contract)
    assert tenant["messages"][0]["content"][0]["uuid"] == f"t:{tenant_digest('acme')}:{mm_hash(PNG)}"


def test_a_pixel_free_item_without_its_fields_and_a_miss_are_refused_naming_the_part() -> None:
    part = {"type": "image_url", "image_url": {"url": PNG_URL}}
    plan = check_chat_request(_chat(part))
    with pytest.raises(EPDError, match=r"lacks \['image_grid_thw'\]") as info:
        apply_results(_chat(part), plan, [_answer("encoded", {})], EpdContract.from_model(QWEN))
    assert info.value.where == "messages[0].content[0]"
    for contract in (QWEN, INTERNVL):
        with pytest.raises(EPDError, match="holds no embedding for image"):
            apply_results(_chat(part), plan, [_answer("miss", {})], EpdContract.from_model(contract))
