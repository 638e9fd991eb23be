"""Gemma 4 images: its own vision tower at the image's aspect ratio, pooled k x k, then embedded.

The image processor resizes an image, aspect ratio kept, to the largest size whose sides are
multiples of ``patch_size * pooling_kernel_size`` (48 px for the hub's checkpoints) within
``max_soft_tokens`` x k² patches, cuts it into patches and pads them to that many (positions
(-1, -1)). The tower runs every padded patch set (padding masked out), average-pools each k x k
block of real patches to one row, scales and standardises it; the multimodal embedder RMS-norms
(no scale) and projects it into the language model: ``Gemma4Model.get_image_features``, and what
vLLM's ``gemma4_mm.py`` returns from ``embed_multimodal`` (``_process_image_input``): one row per
pooled block, (H / 48) x (W / 48), at most ``max_soft_tokens`` (280).

vLLM sizes the placeholder from the image size alone (``_compute_num_soft_tokens``), with the
vision config's ``default_output_length`` as the budget, its ``patch_size`` and
``pooling_kernel_size``; the processor makes the rows with its own three. The loader refuses a
checkpoint where they differ (vLLM's prompt would not match its tower's rows), and one without
``default_output_length`` (vLLM 0.32 cannot size its prompt). ``count_tokens`` is vLLM's rule.

Every image is padded to the same patch count, so a batch stacks; the tower's rows of a batch come
back as one sequence of each image's rows in order, split by their counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import Gemma4Config
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, apply_call_defaults, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "Gemma4Encoder", "Gemma4Vision", "load_gemma4", "soft_tokens"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# The hub's checkpoints and transformers' save_pretrained (5.19 and 5.25 alike): ``model.vision_tower.*``
# and ``model.embed_vision.*``; vLLM's loader maps the same two prefixes.
LAYOUTS: list[Layout] = [
    {"model.vision_tower.": "vision_tower.", "model.embed_vision.": "embed_vision."},
    {"vision_tower.": "vision_tower.", "embed_vision.": "embed_vision."},
]


class Gemma4Vision(torch.nn.Module):
    """``Gemma4Model`` without its language and audio models (its attribute names, so its weight keys)."""

    def __init__(self, config: Gemma4Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, pooling, budget, embedder); the text model is never built
        vision, text = cast(Any, config.vision_config), cast(Any, config.text_config)  # configs once loaded
        self.vision_tower = Gemma4VisionModel._from_config(vision, dtype=dtype)
        self.embed_vision = Gemma4MultimodalEmbedder(vision, text)

    def forward(self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor) -> torch.Tensor:
        """B x P x 3p² patches and their B x P x 2 positions -> every image's rows, in order, x D."""
        pooled = self.vision_tower(pixel_values=pixel_values, pixel_position_ids=pixel_position_ids)
        return self.embed_vision(pooled.last_hidden_state)


def soft_tokens(width: int, height: int, *, patch_size: int, pooling_kernel_size: int, max_soft_tokens: int) -> int:
    """The rows of a ``width`` x ``height`` image, from its size alone, as vLLM 0.32's
    ``Gemma4ProcessingInfo._compute_num_soft_tokens`` counts its placeholder: the image scaled to
    ``max_soft_tokens`` x k² patches, each side floored to a multiple of the pooled unit (at least
    one), capped at ``max_soft_tokens`` (the image processor's ``get_aspect_ratio_preserving_size``
    gives the same count for every size: tests/unit/encoders/test_gemma4.py)."""
    unit = patch_size * pooling_kernel_size
    scale = math.sqrt(max_soft_tokens * pooling_kernel_size**2 / ((height / patch_size) * (width / patch_size)))
    target_height = max(unit, math.floor(height * scale / unit) * unit)
    target_width = max(unit, math.floor(width * scale / unit) * unit)
    patches = (target_height // patch_size) * (target_width // patch_size)
    return min(patches // pooling_kernel_size**2, max_soft_tokens)


class Gemma4Encoder(HFEncoder):
    """Variable N, at most ``max_soft_tokens``; ``cost_tokens`` is the tower's padded patch count,
    the same for every image (the tower attends over all of them)."""

    module: Gemma4Vision

    def __init__(self, module: Gemma4Vision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="gemma4",
            output="projected",
            hidden_size=int(module.embed_vision.embedding_projection.out_features),
            weights_digest=digest,
        )
        vision: Any = module.config.vision_config
        self.patch_size = int(vision.patch_size)
        self.pooling_kernel_size = int(vision.pooling_kernel_size)
        self.max_soft_tokens = int(vision.default_output_length)
        self.max_patches = self.max_soft_tokens * self.pooling_kernel_size**2

    def preprocess(self, image: Image.Image) -> PreparedItem:
        inputs = self._process(image)
        num_tokens = int(inputs["num_soft_tokens_per_image"][0])
        return PreparedItem(
            inputs={"pixel_values": inputs["pixel_values"], "pixel_position_ids": inputs["image_position_ids"]},
            num_tokens=num_tokens,
            cost_tokens=self.cost_of(num_tokens, {}),
        )

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        return soft_tokens(width, height, patch_size=self.patch_size, pooling_kernel_size=self.pooling_kernel_size,
                           max_soft_tokens=self.max_soft_tokens), {}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return self.max_patches

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        """The whole batch in one pass (every image has ``max_patches`` patches); each item's rows
        are its own, by count."""
        with torch.inference_mode():
            rows = self._to_host(self.module(inputs["pixel_values"], inputs["pixel_position_ids"]))
        return [to_encoded(item) for item in torch.split(rows, [item.num_tokens for item in batch])]


def _check(config: Gemma4Config, processor: Any) -> None:
    """Refuse what vLLM 0.32 would size otherwise than its tower's rows: a vision config without
    ``default_output_length`` (vLLM's image budget; it fails without one), an image processor
    whose patch size, pooling or budget is not the model's, or that does not resize."""
    vision: Any = config.vision_config
    if vision is None:
        raise ValueError("a Gemma 4 checkpoint without a vision_config has no image tower")
    budget = getattr(vision, "default_output_length", None)
    if budget is None:
        raise ValueError("vision_config has no default_output_length (vLLM 0.32 sizes an image's placeholder by it)")
    for name, model_value in (("patch_size", vision.patch_size), ("pooling_kernel_size", vision.pooling_kernel_size),
                              ("max_soft_tokens", budget)):
        if int(getattr(processor, name)) != int(model_value):
            raise ValueError(f"the image processor's {name} {getattr(processor, name)} != the model's {model_value}")
    if not processor.do_resize:
        raise ValueError("the image processor must resize (vLLM sizes the placeholder from the resized image)")


def load_gemma4(files: CheckpointFiles, config: Gemma4Config, processor: Any, spec: LoadSpec) -> Gemma4Encoder:
    """The Gemma 4 adapter: the vision tower and its embedder from the checkpoint; the language
    and audio models never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Gemma 4 model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    apply_call_defaults(processor, Gemma4Processor)
    _check(config, processor)
    module = empty_module(lambda: Gemma4Vision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Gemma4Encoder(module, processor, spec, digest)


# vLLM 0.32's gemma4_mm.py takes pixels only: its parser declares no embedding fields, and
# _parse_and_validate_image_input asserts that no image_embeds come. The prefill request carries
# the image and the uuid. (Its videos, frames through the same tower, are not served here.)
FAMILY = Family(
    name="gemma4",
    model_types=("gemma4",),
    load=load_gemma4,
    epd=Epd("pixels_uuid", vllm_model="gemma4_mm.py"),
)
