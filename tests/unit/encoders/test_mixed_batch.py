"""A batch of a batched-preprocessing encoder may hold both kinds of item: images waiting as bytes
for the device pipeline (``pending``) and items whose inputs were made on the CPU (a video's
frames). Each kind takes its own pass, and every answer comes back at its item's place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from encode_server.core.errors import BadInput, EncodeServerError
from encode_server.encoders import load_encoder
from encode_server.encoders.base import PreparedItem
from tests.unit.encoders.util import noise_image


class _Pipeline:
    """Stands in for ``BatchedPipeline.run`` with the CPU preprocessing: the pending items are images;
    one named "bad" fails alone, as a stream the device decoder refuses."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.batches: list[int] = []

    def run(self, batch: Sequence[Any]) -> tuple[dict[str, torch.Tensor] | None, list[EncodeServerError | None]]:
        self.batches.append(len(batch))
        errors: list[EncodeServerError | None] = [
            BadInput("cannot decode", type="invalid_image") if p == "bad" else None for p in batch
        ]
        made = [self.encoder.preprocess(p).inputs for p in batch if p != "bad"]
        return {k: torch.cat([m[k] for m in made]) for k in made[0]}, errors


def test_waiting_images_and_cpu_made_inputs_each_take_their_pass() -> None:
    encoder: Any = load_encoder("builtin:tiny", device="cpu")
    images = [noise_image(64 + 28 * i, 56, seed=i) for i in range(3)]
    expected = [encoder.forward([encoder.preprocess(image)])[0] for image in images]
    assert not encoder.preprocesses_on_device
    encoder.batched = pipeline = _Pipeline(encoder)
    assert encoder.preprocesses_on_device  # what app.py asks: such passes run one at a time

    def waiting(image: Any) -> PreparedItem:
        made = encoder.preprocess(image)
        return PreparedItem({}, made.num_tokens, made.cost_tokens, made.meta, pending=image)

    ready = encoder.preprocess(images[1])  # inputs made on the CPU, as a video's are
    bad = PreparedItem({}, 1, 4, {}, pending="bad")
    out = encoder.forward([waiting(images[0]), ready, bad, waiting(images[2])])
    assert pipeline.batches == [3]  # the three waiting items in one device pass, the ready one apart
    assert isinstance(out[2], BadInput)
    for got, want in zip([out[0], out[1], out[3]], expected, strict=True):
        assert not isinstance(got, EncodeServerError)
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert torch.allclose(torch.frombuffer(bytearray(got.data), dtype=torch.float32),
                              torch.frombuffer(bytearray(want.data), dtype=torch.float32), atol=1e-5)
