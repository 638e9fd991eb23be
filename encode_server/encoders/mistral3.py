"""Mistral 3 (Mistral Small 3.1 / 3.2, HF format): a Pixtral tower at the image's own aspect ratio,
a 2 x 2 patch merger and an MLP projector.

The image processor scales an image down to fit ``longest_edge`` (never up past it; aspect ratio
kept) and pads each side up to a multiple of ``patch_size * spatial_merge_size`` (28 px):
``Mistral3Model.get_image_features`` then gives (H / 28) x (W / 28) rows, in row-major order, what
vLLM's ``mistral3.py`` returns from ``embed_multimodal``. The prompt's ``[IMG_BREAK]`` after each
row and ``[IMG_END]`` are text tokens, not embedding rows. ``meta``: ``{"image_sizes": [H, W]}``,
the processed size.

``PixtralProcessor`` calls the image processor with ``patch_size = patch_size * spatial_merge_size``
over the saved value; so does the server. A batch is one pass: each image's patches are embedded at
its own size (no padding to the batch's largest), the images' patches packed into one sequence,
and each image attends within itself in one attention call per layer (``varlen.py``; the model's
own batched call masks a block-diagonal matrix over the whole sequence instead). Sizes come from
the host (``meta``), so nothing in the pass asks the device for a number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from transformers import Mistral3Config, PixtralVisionModel
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

from encode_server.core.errors import EncodeServerError

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .varlen import cu_seqlens_on, segments, use_varlen

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

    def forward(self, pixels: Sequence[torch.Tensor], sizes: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Each image (1 x 3 x H' x W', at least its processed size) and its processed (H, W) -> the
        images' rows x D, in order: ``PixtralVisionModel``'s forward and ``hidden_states[feature_layer]``,
        with the images packed as its flash-attention path packs them."""
        tower = self.vision_tower
        patch = tower.patch_size
        grids = [(h // patch, w // patch) for h, w in sizes]
        embeds = [tower.patch_conv(p.to(tower.patch_conv.weight.dtype))[0, :, :h, :w].flatten(1).T
                  for p, (h, w) in zip(pixels, grids, strict=True)]
        x = tower.ln_pre(torch.cat(embeds).unsqueeze(0))
        rows = np.concatenate([np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 2)
                               for h, w in grids])
        position_ids = torch.from_numpy(rows).to(x.device, non_blocking=True)
        position_embeddings = tower.patch_positional_embedding(x, position_ids)
        lengths = [h * w for h, w in grids]
        cu_seqlens, layouts = cu_seqlens_on(np.concatenate([[0], np.cumsum(lengths)]), x.device)
        packed = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max(lengths),
                  "max_length_k": max(lengths)}
        layers = tower.transformer.layers
        depth = self.feature_layer % (len(layers) + 1)  # hidden_states[i] is the output of i layers
        with segments(layouts):
            for layer in layers[:depth]:
                x = layer(x, None, position_embeddings=position_embeddings, **packed)
        return self.multi_modal_projector(x.squeeze(0), [(h * patch, w * patch) for h, w in grids])


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
        """One pass: each image keeps its own size, so their pixels are not stacked but moved one
        by one (the device-preprocessed path's batch comes padded, as the processor pads it)."""
        if not batch or (self.batched is not None and any(item.pending is not None for item in batch)):
            return super().forward(batch)
        pixels = [self._to_device([item.inputs["pixel_values"]]) for item in batch]
        return [*self._run(batch, pixels)]

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        return self._run(batch, list(inputs["pixel_values"].unsqueeze(1)))

    def _run(self, batch: Sequence[PreparedItem], pixels: Sequence[torch.Tensor]) -> list[EncodedTensor]:
        sizes = [(int(item.meta["image_sizes"][0]), int(item.meta["image_sizes"][1])) for item in batch]
        with torch.inference_mode():
            rows = self._to_host(self.module(pixels, sizes))
        return [to_encoded(part) for part in torch.split(rows, [item.num_tokens for item in batch])]


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
    use_varlen(module.vision_tower)
    return Mistral3Encoder(module, processor, spec, digest)


# vLLM 0.32's mistral3.py takes pixels only (its parser declares no embedding fields; an
# image_embeds item is refused before the model): the prefill request carries the image and the uuid.
FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    load=load_mistral3,
    epd=Epd("pixels_uuid", vllm_model="mistral3.py"),
)
