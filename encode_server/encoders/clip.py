"""CLIP and SigLIP vision towers: every image is resized to one size, so N is fixed.

Outputs, as the retrieval and VLM worlds use them:
- ``hidden``: the tower's last hidden state, N x D (CLIP's N counts its CLS token).
- ``pooled``: one 1 x D vector per image. CLIP: the projected image embedding
  (``CLIPModel.get_image_features``, i.e. ``CLIPVisionModelWithProjection.image_embeds``), so it
  lives in the text tower's space; SigLIP: the vision model's attention-pooled ``pooler_output``.

Reads a full ``CLIPModel``/``SiglipModel`` checkpoint (``vision_model.*``; the text tower is never
read) or a vision-only one (``vision_model.*``, or transformers 5's unprefixed keys).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers import (
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    PretrainedConfig,
    SiglipVisionModel,
)

from .base import EncodedTensor, PreparedItem
from .family import Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "ClipEncoder", "FixedResolutionEncoder", "load_clip"]

OUTPUTS = ("hidden", "pooled")


class FixedResolutionEncoder(HFEncoder):
    """An adapter whose every image has the same N: batches are stacked, ``count_tokens`` is a constant.

    Subclasses set ``num_tokens`` (rows of each embedding) and ``cost_tokens`` (tokens through the
    tower) and implement ``_embed``.
    """

    num_tokens: int
    cost_tokens: int

    def preprocess(self, image: Image.Image) -> PreparedItem:
        pixel_values = self._process(image)["pixel_values"]
        return PreparedItem({"pixel_values": pixel_values}, self.num_tokens, self.cost_tokens)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        return self.num_tokens, {}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return self.cost_tokens

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        with torch.inference_mode():
            embeddings = self._embed(inputs["pixel_values"])
        return [to_encoded(embedding) for embedding in self._to_host(embeddings)]

    @abstractmethod
    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """B x N x D embeddings for a B x C x H x W batch."""


class ClipEncoder(FixedResolutionEncoder):
    """A CLIP or SigLIP vision tower (``kind`` says which), with CLIP's projection when ``pooled``."""

    def __init__(self, module: torch.nn.Module, processor: Any, spec: LoadSpec, *, kind: str, digest: str):
        self._pooled = spec.output == "pooled"
        tower: Any = module.vision_model if isinstance(module, CLIPVisionModelWithProjection) else module
        hidden_size = int(tower.config.hidden_size)
        if self._pooled and isinstance(module, CLIPVisionModelWithProjection):
            hidden_size = int(module.config.projection_dim)
        super().__init__(
            module, processor, spec, kind=kind, output=spec.output, hidden_size=hidden_size, weights_digest=digest
        )
        self.cost_tokens = int(tower.embeddings.num_positions)
        self.num_tokens = 1 if self._pooled else self.cost_tokens

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        outputs = self.module(pixel_values=pixel_values)
        if not self._pooled:
            return outputs.last_hidden_state
        if isinstance(self.module, CLIPVisionModelWithProjection):
            return outputs.image_embeds.unsqueeze(1)
        return outputs.pooler_output.unsqueeze(1)


def _vision_config(config: PretrainedConfig) -> PretrainedConfig:
    """The vision config of a full model's config (carrying its ``projection_dim``), or the config itself."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return config
    if hasattr(config, "projection_dim"):
        vision.projection_dim = config.projection_dim
    return vision


def load_clip(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> ClipEncoder:
    """The CLIP/SigLIP adapter: the vision tower (plus CLIP's ``visual_projection`` when pooled) only."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"output for a CLIP/SigLIP model must be one of {OUTPUTS}, not {spec.output!r}")
    kind = "siglip" if config.model_type.startswith("siglip") else "clip"
    vision = _vision_config(config)
    layouts: list[Layout]
    if kind == "siglip" and spec.output == "pooled" and not getattr(vision, "vision_use_head", True):
        raise ValueError(f"{spec.model_id} has no SigLIP pooling head (vision_use_head=False): use output 'hidden'")
    if kind == "clip" and spec.output == "pooled":
        cls: Any = CLIPVisionModelWithProjection
        layouts = [{"vision_model.": "vision_model.", "visual_projection.": "visual_projection."}]
    else:
        cls = SiglipVisionModel if kind == "siglip" else CLIPVisionModel
        layouts = [{"vision_model.": ""}, {"": ""}]
    module = empty_module(lambda: cls._from_config(vision, dtype=spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, layouts)
    return ClipEncoder(module, processor, spec, kind=kind, digest=digest)


# Retrieval towers: no language model consumes them through EPD.
FAMILY = Family(
    name="clip", model_types=("clip", "clip_vision_model", "siglip", "siglip_vision_model"), load=load_clip
)
