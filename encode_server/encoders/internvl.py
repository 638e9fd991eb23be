"""InternVL (HF format: InternVL3, InternVL3.5): 448-px tiles, pixel shuffle, MLP projector.

The image processor cuts each image into a grid of tiles (the grid of at most ``max_patches`` tiles
whose aspect ratio is nearest the image's) plus a thumbnail when there is more than one tile. Each
tile goes through InternViT on its own; the last layer's patch tokens (CLS dropped) are
pixel-shuffled by ``downsample_ratio`` (2x2 neighbours into one token) and projected into the
language model's hidden size: ``(image_size / patch_size)**2 * downsample_ratio**2`` rows a tile
(256 for the hub's checkpoints). An image's embedding is its tiles' rows in tile order, thumbnail
last: what vLLM's ``interns1.py`` (which serves ``InternVLForConditionalGeneration``) returns from
``embed_multimodal`` and holds in its encoder cache, with ``{"image_num_patches": tiles}`` as meta.

Two of vLLM's choices are followed rather than the checkpoint's: the features are always the last
layer's, CLS dropped (``extract_feature``), whatever ``vision_feature_layer`` says; and the image is
always tiled, because ``InternVLProcessor`` passes ``crop_to_patches=True`` at call time over the
image processor's saved attribute (whose class default is False).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import InternVLConfig, InternVLProcessor
from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector, InternVLVisionModel

from encode_server.core.settings import Setting

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, apply_call_defaults, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "InternVLEncoder", "InternVLVision", "load_internvl"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# transformers 5's ``save_pretrained`` (and the hub's -hf checkpoints) write the legacy names;
# a checkpoint re-saved from the current module tree nests them under ``model.``.
LAYOUTS: list[Layout] = [
    {"model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."},
]


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """``InternVLModel.pixel_shuffle`` (and vLLM's): (n, w, h, c) -> (n, w*scale, h*scale, c/scale**2)."""
    n, w, h, c = features.shape
    features = features.reshape(n, w, int(h * scale), int(c / scale)).permute(0, 2, 1, 3).contiguous()
    features = features.reshape(n, int(h * scale), int(w * scale), int(c / scale**2))
    return features.permute(0, 2, 1, 3).contiguous()


class InternVLVision(torch.nn.Module):
    """``InternVLModel`` without its language model: same attribute names, hence the same weight keys."""

    def __init__(self, config: InternVLConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, ratio, projector); the text model is never built
        self.vision_tower = InternVLVisionModel._from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self.downsample_ratio = float(config.downsample_ratio)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles (T x 3 x H x W) -> T x rows-a-tile x D."""
        hidden = self.vision_tower(pixel_values=pixel_values).last_hidden_state[:, 1:]
        tiles, tokens, channels = hidden.shape
        side = math.isqrt(tokens)
        shuffled = pixel_shuffle(hidden.reshape(tiles, side, side, channels), self.downsample_ratio)
        return self.multi_modal_projector(shuffled.reshape(tiles, -1, shuffled.shape[-1]))


class InternVLEncoder(HFEncoder):
    """Variable N: ``tiles * rows_per_tile`` rows; ``cost_tokens`` counts every tile's patches and CLS."""

    module: InternVLVision

    def __init__(self, module: InternVLVision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="internvl",
            output="projected",
            hidden_size=module.multi_modal_projector.linear_2.out_features,
            weights_digest=digest,
        )
        vision: Any = module.config.vision_config
        height, width = vision.image_size
        patch_h, patch_w = vision.patch_size
        patches = (height // patch_h) * (width // patch_w)
        self.rows_per_tile = int(patches * module.downsample_ratio**2)
        self.tokens_per_tile = patches + 1

    def _tiles(self, width: int, height: int, settings: Mapping[str, Any] | None = None) -> int:
        return int(self.processor.get_number_of_image_patches(height, width, dict(settings or {})))

    def preprocess(self, image: Image.Image) -> PreparedItem:
        return self._prepared(self._process(image))

    def setting_defaults(self) -> dict[str, Any]:
        """The image processor's tile range (vLLM's ``interns1.py`` reads the same attributes)."""
        return {"min_patches": int(self.processor.min_patches), "max_patches": int(self.processor.max_patches)}

    def preprocess_with(self, image: Image.Image, settings: Mapping[str, Any]) -> PreparedItem:
        """The image processor called with the tile range, as vLLM's HF processor call passes a
        request's ``mm_processor_kwargs`` on to it."""
        return self._prepared(dict(self.processor(images=image, return_tensors="pt", **settings)))

    def count_tokens_with(self, width: int, height: int, settings: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        tiles = self._tiles(width, height, settings)
        return tiles * self.rows_per_tile, {"image_num_patches": tiles}

    def _prepared(self, inputs: dict[str, torch.Tensor]) -> PreparedItem:
        tiles = int(inputs["num_patches"][0])
        return PreparedItem(
            inputs={"pixel_values": inputs["pixel_values"]},
            num_tokens=tiles * self.rows_per_tile,
            cost_tokens=tiles * self.tokens_per_tile,
            meta={"image_num_patches": tiles},
        )

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's own tiling rule (``get_number_of_image_patches``), not the model."""
        tiles = self._tiles(width, height)
        return tiles * self.rows_per_tile, {"image_num_patches": tiles}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return int(meta["image_num_patches"]) * self.tokens_per_tile

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        with torch.inference_mode():
            rows = self._to_host(self.module(inputs["pixel_values"]))
        tiles = [int(item.meta["image_num_patches"]) for item in batch]
        return [to_encoded(item.flatten(0, 1)) for item in torch.split(rows, tiles)]


def _check_processor(files: CheckpointFiles, config: InternVLConfig, processor: Any, rows_per_tile: int) -> None:
    """Refuse a checkpoint whose processor and tower disagree: vLLM would size placeholders from the
    one (``image_seq_length``) and fill them from the other, and fail every request."""
    size, vision = processor.size, cast(Any, config.vision_config)
    tile, tower = [int(size["height"]), int(size["width"])], [int(x) for x in vision.image_size]
    if tile != tower:
        raise ValueError(f"image processor tiles of {tile} px do not match the tower's {tower}")
    seq_length = files.processor_setting("image_seq_length")
    if seq_length is not None and int(seq_length) != rows_per_tile:
        raise ValueError(f"processor_config.json image_seq_length {seq_length} != the tower's {rows_per_tile} a tile")


def load_internvl(files: CheckpointFiles, config: InternVLConfig, processor: Any, spec: LoadSpec) -> InternVLEncoder:
    """The InternVL adapter: InternViT and the projector from the checkpoint, the language model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"an InternVL model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    apply_call_defaults(processor, InternVLProcessor)  # crop_to_patches=True (see the module docstring)
    module = empty_module(lambda: InternVLVision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    encoder = InternVLEncoder(module, processor, spec, digest)
    _check_processor(files, config, processor, encoder.rows_per_tile)
    return encoder


# vLLM's per-request keys for an InternVL (HF format) image: the tile range its HF processor takes
# (GotOcr2ImageProcessor's min_patches/max_patches; vLLM's interns1.py passes mm_processor_kwargs
# to it). Each tile is one pass of the tower: never more than the checkpoint's own max_patches (the
# warm-up's worst case; 12 for the hub's checkpoints).
SETTINGS = (
    Setting("min_patches", "int", "the fewest tiles an image is cut into (before the thumbnail)",
            minimum=1, ceiling="max_patches"),
    Setting("max_patches", "int", "the most tiles an image is cut into (before the thumbnail): fewer rows",
            minimum=1, ceiling="max_patches"),
)

# vLLM 0.32's interns1.py parser declares no embedding fields: the prefill request carries the
# image (its processor tiles it to size the placeholder) and the uuid; the connector fills it.
FAMILY = Family(
    name="internvl",
    model_types=("internvl",),
    load=load_internvl,
    epd=Epd("pixels_uuid", vllm_model="interns1.py"),
    settings=SETTINGS,
)
