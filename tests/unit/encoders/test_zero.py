"""``builtin:zero``: the real path around a tower that computes nothing, rows of a real tower's
shape and dtype, and no copy of them per image."""

from __future__ import annotations

import pytest

from encode_server.encoders import load_encoder
from encode_server.encoders.zero import ZERO_MODELS
from encode_server.kinds import image_inputs
from tests.images import image_bytes

SHAPES = {"builtin:zero": (729, 1152), "builtin:zero-qwen7b": (391, 3584)}


def test_the_zero_models_are_the_towers_they_stand_for() -> None:
    assert set(ZERO_MODELS) == set(SHAPES)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_every_image_gets_the_towers_rows_in_bfloat16_without_a_copy(model: str) -> None:
    encoder = load_encoder(model, device="cpu")
    rows, width = SHAPES[model]
    assert (encoder.info.dtype, encoder.info.hidden_size, encoder.info.meaningless) == ("bfloat16", width, True)
    assert encoder.family is None and encoder.info.num_parameters == 0
    images = [image_bytes("JPEG", 640, 480, seed=1), image_bytes("PNG", 31, 977, seed=2)]
    prepared = [image_inputs(encoder, data, max_pixels=10**8, index=i) for i, data in enumerate(images)]
    side = ZERO_MODELS[model].side
    assert [p.inputs["pixel_values"].numel() for p in prepared] == [side * side * 3] * 2  # decoded and resized
    out = encoder.forward(prepared)
    assert [(t.shape, t.dtype, t.nbytes) for t in out] == [((rows, width), "bfloat16", rows * width * 2)] * 2
    assert out[0].data is out[1].data and not any(out[0].data[:4096])  # one block of zeros, shared
    assert encoder.count_tokens(640, 480) == (rows, {})


def test_another_dtype_is_taken_when_asked_and_an_unknown_name_is_refused() -> None:
    assert load_encoder("builtin:zero", device="cpu", dtype="float32").info.dtype == "float32"
    with pytest.raises(ValueError, match="unknown built-in model"):
        load_encoder("builtin:zero-nothing", device="cpu")
