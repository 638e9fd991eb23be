"""SigLIP2 NaFlex vision towers: each image keeps its aspect ratio within ``max_num_patches``.

The processor resizes an image to an ``h x w`` patch grid of at most ``max_num_patches`` patches
and pads the sequence to exactly ``max_num_patches``, with a mask. Outputs:
- ``hidden``: the last hidden state of the image's own ``h*w`` patches, padding rows dropped (they
  attend to nothing and mean nothing): variable N, ``{"spatial_shapes": [h, w]}`` as meta.
- ``pooled``: the masked attention-pooled ``pooler_output``, 1 x D.

Every image costs ``max_num_patches`` tokens in the tower, padding included. Fixed-resolution
SigLIP2 checkpoints declare ``model_type: siglip`` and take the SigLIP adapter instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers import PretrainedConfig
from transformers.models.siglip2.image_processing_pil_siglip2 import get_image_size_for_max_num_patches
from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

from .base import EncodedTensor, PreparedItem
from .family import Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "Siglip2Encoder", "load_siglip2"]

OUTPUTS = ("hidden", "pooled")
LAYOUTS: list[Layout] = [{"vision_model.": ""}, {"": ""}]


class Siglip2Encoder(HFEncoder):
    """A NaFlex SigLIP2 vision tower; a batch is stacked (every item is padded to one length)."""

    checked_meta = ("spatial_shapes",)  # the batched processor's patch grid must be the header's

    def __init__(self, module: torch.nn.Module, processor: Any, spec: LoadSpec, *, digest: str) -> None:
        config: Any = module.config
        super().__init__(
            module,
            processor,
            spec,
            kind="siglip2",
            output=spec.output,
            hidden_size=int(config.hidden_size),
            weights_digest=digest,
        )
        self._pooled = spec.output == "pooled"
        self.patch_size = int(processor.patch_size)
        self.max_num_patches = int(processor.max_num_patches)

    def _tokens(self, grid: list[int]) -> tuple[int, dict[str, Any]]:
        return (1, {}) if self._pooled else (grid[0] * grid[1], {"spatial_shapes": grid})

    def preprocess(self, image: Image.Image) -> PreparedItem:
        inputs = self._process(image)
        num_tokens, meta = self._tokens([int(x) for x in inputs["spatial_shapes"][0]])
        return PreparedItem(inputs, num_tokens, self.max_num_patches, meta)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's own resize rule: the largest aspect-preserving grid within the patch budget."""
        h, w = get_image_size_for_max_num_patches(height, width, self.patch_size, self.max_num_patches)
        return self._tokens([h // self.patch_size, w // self.patch_size])

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return self.max_num_patches

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        with torch.inference_mode():
            outputs = self.module(
                pixel_values=inputs["pixel_values"],
                pixel_attention_mask=inputs["pixel_attention_mask"],
                spatial_shapes=inputs["spatial_shapes"],
            )
        if self._pooled:
            return [to_encoded(row) for row in self._to_host(outputs.pooler_output).unsqueeze(1)]
        hidden = self._to_host(outputs.last_hidden_state)
        return [to_encoded(rows[: item.num_tokens]) for rows, item in zip(hidden, batch, strict=True)]


def load_siglip2(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> Siglip2Encoder:
    """The SigLIP2 adapter: the vision tower (with its pooling head) only, never the text tower."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"output for a SigLIP2 model must be one of {OUTPUTS}, not {spec.output!r}")
    vision: Any = getattr(config, "vision_config", None) or config
    if spec.output == "pooled" and not vision.vision_use_head:
        raise ValueError(f"{spec.model_id} has no pooling head (vision_use_head=False): use output 'hidden'")
    module = empty_module(lambda: Siglip2VisionModel._from_config(vision, dtype=spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Siglip2Encoder(module, processor, spec, digest=digest)


FAMILY = Family(name="siglip2", model_types=("siglip2", "siglip2_vision_model"), load=load_siglip2)
