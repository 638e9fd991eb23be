"""``builtin:zero``: a tower that costs nothing, so the serving path's own ceiling is a figure.

It answers every image with preallocated rows of a real tower's shape and dtype, without
computing: SigLIP so400m/384's 729 x 1,152 bfloat16 (``builtin:zero``), or Qwen2.5-VL-7B's rows of
a 640x480 image, 391 x 3,584 bfloat16 (``builtin:zero-qwen7b``). Everything around the tower is the
real path: the door's parsing, hashing, the tiers, decoding (Pillow, EXIF applied), a resize to
the tower's input size (384 x 384, as SigLIP's processor), the batcher, the answer's bytes. What a
server with it serves per second, and the CPU and GIL time it spends per request, is what the
serving path costs; the tower's own cost on a GPU is apart (``bench/gpu_check.sh``).

Its rows are all zeros (``info.meaningless``); every process holds the same ``weights_digest``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from encode_server.core.errors import EncodeServerError
from encode_server.core.hashing import fingerprint
from encode_server.core.types import EncodedTensor

from .base import Encoder, EncoderInfo, PreparedItem

__all__ = ["ZERO_MODELS", "ZeroCostEncoder", "load_zero"]


@dataclass(frozen=True)
class _Shape:
    rows: int
    width: int
    side: int  # the square input the real tower takes, which preprocessing resizes to


ZERO_MODELS: dict[str, _Shape] = {
    "builtin:zero": _Shape(729, 1152, 384),  # SigLIP so400m/384
    "builtin:zero-qwen7b": _Shape(391, 3584, 448),  # Qwen2.5-VL-7B, a 640x480 image (17 x 23 merged)
}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class ZeroCostEncoder(Encoder):
    """Preprocessing resizes the decoded image to the tower's input (the host work a real
    processor does, in one Pillow call); ``forward`` hands back one preallocated block of rows per
    image: no computation, no copy (every answer shares the one ``bytes`` object)."""

    def __init__(self, model_id: str, device: torch.device, dtype: str) -> None:
        shape = ZERO_MODELS[model_id]
        self.shape = shape
        self._rows = bytes(shape.rows * shape.width * _ITEMSIZE[dtype])
        self._dtype = dtype
        config = {"rows": shape.rows, "width": shape.width, "side": shape.side}
        self.info = EncoderInfo(
            model_id=model_id, revision=None, kind="zero_cost", output="hidden", dtype=dtype, device=str(device),
            hidden_size=shape.width, weights_digest=fingerprint({"zero_cost": config}),
            preprocessing={"resize": [shape.side, shape.side], "resample": "bilinear"}, num_parameters=0,
            meaningless=True, architecture=config,
        )

    def preprocess(self, image: Image.Image) -> PreparedItem:
        side = self.shape.side
        pixels = image.resize((side, side), Image.Resampling.BILINEAR)
        return PreparedItem({"pixel_values": torch.frombuffer(bytearray(pixels.tobytes()), dtype=torch.uint8)},
                            self.shape.rows, self.shape.rows)

    def host_twin(self) -> Encoder | None:
        twin = copy.copy(self)
        twin._rows = b""  # the answer's block: forward's, never a worker's
        return twin

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        return [EncodedTensor(self._rows, (self.shape.rows, self.shape.width), self._dtype) for _ in batch]

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        return self.shape.rows, {}


def load_zero(model_id: str, device: torch.device, dtype: str) -> ZeroCostEncoder:
    """A zero-cost tower by name; ``dtype`` its rows' (bfloat16, as the towers it stands for)."""
    if model_id not in ZERO_MODELS:
        raise ValueError(f"unknown zero-cost model {model_id!r}; zero-cost models: {list(ZERO_MODELS)}")
    return ZeroCostEncoder(model_id, device, dtype)
