"""The one interface every model family implements.

Split as infinity's batch handler is: ``preprocess`` (CPU, any worker thread, per image) is apart
from ``forward`` (one thread, a batch of many requests' images) so that decoding and resizing the
next images overlaps with the forward pass of the current batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from encode_server.core.types import EncodedTensor

from .family import Family

__all__ = ["EncodedTensor", "EncoderInfo", "PreparedImage", "VisionEncoder"]


@dataclass(frozen=True)
class EncoderInfo:
    """What the encoder is; every field that changes the embedding feeds the fingerprint."""

    model_id: str
    revision: str | None
    kind: str  # "clip" | "siglip" | "llava" | "qwen2_vl" | "qwen2_5_vl"
    output: str  # "hidden" | "pooled" | "projected" | "merged"
    dtype: str  # "float32" | "bfloat16" | "float16": the embedding's dtype
    device: str
    hidden_size: int  # D, the embedding's last dimension
    weights_digest: str  # BLAKE3 over the loaded (vision-only) state dict
    preprocessing: dict[str, Any]  # the image processor's config, JSON-able
    num_parameters: int  # resident parameters: the vision tower (+ projector) only
    meaningless: bool = False  # built-in random weights: deterministic, not useful
    # The module's config (depth, feature layer, window size...), machine-specific keys removed:
    # editing config.json next to unchanged weights must change the fingerprint too.
    architecture: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreparedImage:
    """One image turned into model inputs; ``cost_tokens`` is what it weighs in a batch."""

    inputs: dict[str, torch.Tensor]
    num_tokens: int  # N, the rows of this image's embedding
    cost_tokens: int  # patch tokens through the vision tower (budgeted by --max-batch-tokens)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able, e.g. {"image_grid_thw": [1, 8, 12]}


class VisionEncoder(ABC):
    """A loaded vision tower (and projector). ``preprocess`` is thread-safe; ``forward`` is called
    from one thread at a time, under ``torch.inference_mode``."""

    info: EncoderInfo
    family: Family | None = None  # set by ``load_encoder``: what the server publishes about it
    dtype_reason: str = ""  # set by ``load_encoder``: why this dtype (``GET /v1/model``)

    @abstractmethod
    def preprocess(self, image: Image.Image) -> PreparedImage:
        """An RGB image (EXIF orientation already applied) to inputs, its token count and meta."""

    @abstractmethod
    def forward(self, batch: Sequence[PreparedImage]) -> list[EncodedTensor]:
        """One forward pass over ``batch``; one embedding per image, in order."""

    @abstractmethod
    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """(N, meta) for an image of this size, without running the model."""
