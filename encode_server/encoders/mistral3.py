"""Mistral 3 (Mistral Small 3.1 / 3.2, HF format): a Pixtral tower at the image's own aspect ratio,
a 2 x 2 patch merger and an MLP projector.

The image processor scales an image down to fit ``longest_edge`` (never up past it; aspect ratio
kept) and pads each side up to a multiple of ``patch_size * spatial_merge_size`` (28 px):
``Mistral3Model.get_image_features`` then gives (H / 28) x (W / 28) rows, in row-major order, what
vLLM's ``mistral3.py`` returns from ``embed_multimodal``. The prompt's ``[IMG_BREAK]`` after each
row and ``[IMG_END]`` are text tokens, not embedding rows. ``meta``: ``{"image_sizes": [H, W]}``,
the processed size.

``PixtralProcessor`` calls the image processor with ``patch_size = patch_size * spatial_merge_size``
over the saved value; so does the server. Each image is its own sequence through the tower (the
model's batched call runs them as one sequence under a block mask): a batch is a loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import Mistral3Config, PixtralVisionModel
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

from encode_server.core.errors import EncodeServerError

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "Mistral3Encoder", "Mistral3Vision", "load_mistral3"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

LAYOUTS: list[Layout] = [
    {"model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."},
]


class Mistral3Vision(torch.nn.Module):
    """``Mistral3Model`` without its language model (its attribute names, so its weight keys)."""

    def __init__(self, config: Mistral3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, feature layer, merger); the text model is never built
        self.vision_tower = PixtralVisionModel._from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = Mistral3MultiModalProjector(config)
        self.feature_layer = int(cast(Any, config).vision_feature_layer)  # one layer: checked at load

    def forward(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """One image (1 x 3 x H x W, its [[H, W]]) -> its rows x D."""
        out = self.vision_tower(pixel_values, image_sizes=image_sizes, output_hidden_states=True, return_dict=True)
        return self.multi_modal_projector(out.hidden_states[self.feature_layer].squeeze(0), image_sizes)


class Mistral3Encoder(HFEncoder):
    """Variable N: (H / merged patch) x (W / merged patch); ``cost_tokens`` is the tower's patches."""

    module: Mistral3Vision

    def __init__(self, module: Mistral3Vision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="mistral3",
            output="projected",
            hidden_size=module.multi_modal_projector.linear_2.out_features,
            weights_digest=digest,
        )
        vision: Any = module.config.vision_config
        self.patch = int(vision.patch_size)
        self.merged = self.patch * int(module.config.spatial_merge_size)
        self.longest_edge = int(processor.size["longest_edge"])

    def _size(self, width: int, height: int) -> tuple[int, int]:
        """The processed (H, W): ``get_resize_output_image_size``'s rule (and vLLM's
        ``get_patch_grid_size``), by arithmetic on the size alone."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        return ((height - 1) // self.merged + 1) * self.merged, ((width - 1) // self.merged + 1) * self.merged

    def preprocess(self, image: Image.Image) -> PreparedItem:
        inputs = self._process(image)
        height, width = (int(x) for x in inputs["image_sizes"][0])
        return PreparedItem(
            inputs={"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]},
            num_tokens=(height // self.merged) * (width // self.merged),
            cost_tokens=(height // self.patch) * (width // self.patch),
            meta={"image_sizes": [height, width]},
        )

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        h, w = self._size(width, height)
        return (h // self.merged) * (w // self.merged), {"image_sizes": [h, w]}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        height, width = meta["image_sizes"]
        return (int(height) // self.patch) * (int(width) // self.patch)

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        """One pass per image: each keeps its own aspect ratio, so their pixels do not stack."""
        out: list[EncodedTensor | EncodeServerError] = []
        for item in batch:  # a loop, not a comprehension: zero-argument super() needs this frame
            out += super().forward([item])
        return out

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        with torch.inference_mode():
            return [to_encoded(self._to_host(self.module(inputs["pixel_values"], inputs["image_sizes"])))]


def _check(files: CheckpointFiles, config: Mistral3Config, processor: Any) -> None:
    """Refuse what vLLM would size otherwise than the server: a multimodal processor whose patch or
    merge size is not the model's, a feature layer list (vLLM takes only the deepest layer)."""
    vision: Any = config.vision_config
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError(f"vision_feature_layer {config.vision_feature_layer}: only one layer is served (as vLLM)")
    for name, value in (("patch_size", vision.patch_size), ("spatial_merge_size", config.spatial_merge_size)):
        saved = files.processor_setting(name)
        if saved is not None and int(saved) != int(value):
            raise ValueError(f"processor_config.json {name} {saved} != the model's {value}")
    if not processor.do_resize or "longest_edge" not in processor.size:
        raise ValueError("the image processor must resize to a longest_edge (vLLM sizes the placeholder so)")


def load_mistral3(files: CheckpointFiles, config: Mistral3Config, processor: Any, spec: LoadSpec) -> Mistral3Encoder:
    """The Mistral 3 adapter: Pixtral and the projector from the checkpoint, the language model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Mistral 3 model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    _check(files, config, processor)
    merged = int(cast(Any, config.vision_config).patch_size) * int(config.spatial_merge_size)
    processor.patch_size = {"height": merged, "width": merged}  # as PixtralProcessor calls it
    module = empty_module(lambda: Mistral3Vision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Mistral3Encoder(module, processor, spec, digest)


# vLLM 0.32's mistral3.py takes pixels only (its parser declares no embedding fields; an
# image_embeds item is refused before the model): the prefill request carries the image and the uuid.
FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    load=load_mistral3,
    epd=Epd("pixels_uuid", vllm_model="mistral3.py"),
)
