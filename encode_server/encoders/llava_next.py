"""LLaVA-NeXT and LLaVA-OneVision: a CLIP or SigLIP tower over any-resolution tiles, unpadded, with
``image_newline`` rows.

The image processor picks the grid pinpoint that best fits the image, resizes and pads it to that
resolution, cuts it into tower-sized tiles and puts the whole image, resized, first (the base
tile). Every tile goes through the tower (the feature layer's hidden states, CLS dropped under the
``default`` strategy) and the projector. Then the rows are packed as the model's own
``pack_image_features`` (and vLLM's ``_merge_image_patch_embeddings``) packs them: the base tile's
rows, then the other tiles laid out as one grid, the padding cut off (unpadded to the image's
aspect ratio), for OneVision bilinearly downscaled when more than "anyres_max_9" tiles' worth
remains, and one ``image_newline`` row after each grid row. That is what vLLM's
``llava_next.py`` / ``llava_onevision.py`` return from ``embed_multimodal``, newline rows included,
in vLLM's order. ``meta``: ``{"image_sizes": [H, W]}`` (the original size, which the unpadding
follows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import AutoModel, PretrainedConfig
from transformers.image_processing_utils import select_best_resolution
from transformers.models.llava_next.modeling_llava_next import LlavaNextModel, LlavaNextMultiModalProjector
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["NEXT", "ONEVISION", "AnyresEncoder", "AnyresVision", "load_llava_next", "load_llava_onevision"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"
ASPECT = "anyres_max_9"  # vLLM 0.32 packs (and counts) OneVision with this, whatever the config says

# The hub's checkpoints (and vLLM's loader): ``vision_tower.vision_model.*``; nested under ``model.``
# when re-saved from the current module tree (transformers 5's CLIP and SigLIP have no
# ``vision_model`` level, and its save_pretrained drops it: vLLM cannot load what it writes).
LAYOUTS: list[Layout] = [
    {"model.vision_tower.vision_model.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector.",
     "model.image_newline": "image_newline"},
    {"vision_tower.vision_model.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector.",
     "image_newline": "image_newline"},
]


class AnyresVision(torch.nn.Module):
    """``LlavaNextModel`` / ``LlavaOnevisionModel`` without the language model (their attribute
    names, so their weight keys); ``onevision`` picks OneVision's packing."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, *, onevision: bool) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, layer, pinpoints); the text model is never built
        self.vision_tower = AutoModel.from_config(cast(Any, config).vision_config, dtype=dtype)
        self.multi_modal_projector = LlavaNextMultiModalProjector(cast(Any, config))  # OneVision's is the same
        self.image_newline = torch.nn.Parameter(torch.empty(cast(Any, config).text_config.hidden_size))
        self.feature_layer = int(cast(Any, config).vision_feature_layer)
        self.strategy = str(cast(Any, config).vision_feature_select_strategy)
        self.onevision = onevision

    def tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles (T x 3 x S x S) -> T x rows-a-tile x D."""
        out = self.vision_tower(pixel_values=pixel_values, output_hidden_states=True, return_dict=True)
        selected = out.hidden_states[self.feature_layer]
        return self.multi_modal_projector(selected[:, 1:] if self.strategy == "default" else selected)

    def pack(self, tiles: torch.Tensor, image_size: torch.Tensor) -> torch.Tensor:
        """One image's tiles' rows -> its packed rows (transformers' own packing, on this module's config)."""
        me: Any = self
        if self.onevision:
            packed, _ = LlavaOnevisionModel.pack_image_features(
                me, [tiles], image_size[None], image_newline=self.image_newline, vision_aspect_ratio=ASPECT
            )
        else:
            packed, _ = LlavaNextModel.pack_image_features(
                me, [tiles], image_size[None], self.strategy, image_newline=self.image_newline
            )
        return packed[0]


class AnyresEncoder(HFEncoder):
    """Variable N (base tile + unpadded grid + a newline row per grid row); ``cost_tokens`` counts
    every tile's patches through the tower."""

    module: AnyresVision

    def __init__(self, module: AnyresVision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="llava_onevision" if module.onevision else "llava_next",
            output="projected",
            hidden_size=module.multi_modal_projector.linear_2.out_features,
            weights_digest=digest,
        )
        config = module.config
        vision: Any = config.vision_config
        self.tile = int(vision.image_size)
        self.side = self.tile // int(vision.patch_size)
        self.pinpoints = [list(p) for p in cast(Any, config.image_grid_pinpoints)]

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's count (``_get_number_of_features`` of the model's processor, and vLLM's)."""
        best_height, best_width = select_best_resolution((height, width), self.pinpoints)
        current_height, current_width = self.side * (best_height // self.tile), self.side * (best_width // self.tile)
        if width / height > current_width / current_height:
            new_height = int(round(height * (current_width / width), 7))
            current_height -= ((current_height - new_height) // 2) * 2
        else:
            new_width = int(round(width * (current_height / height), 7))
            current_width -= ((current_width - new_width) // 2) * 2
        unpadded, newlines = current_height * current_width, current_height
        ratio = math.sqrt(current_height * current_width / (9 * self.side**2))  # OneVision's anyres_max_9
        if self.module.onevision and ratio > 1.1:
            unpadded = int(current_height // ratio) * int(current_width // ratio)
            newlines = int(current_height // ratio)
        return self.side**2 + unpadded + newlines, {"image_sizes": [height, width]}

    def preprocess(self, image: Image.Image) -> PreparedItem:
        inputs = self._process(image)
        pixel_values = inputs["pixel_values"][0]  # this image's tiles (one image: no padding to a batch)
        height, width = (int(x) for x in inputs["image_sizes"][0])
        num_tokens, meta = self.count_tokens(width, height)
        return PreparedItem(
            inputs={"pixel_values": pixel_values, "image_sizes": inputs["image_sizes"][0]},
            num_tokens=num_tokens,
            cost_tokens=pixel_values.shape[0] * self.side**2,
            meta=meta,
        )

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        """A batched (device) item's weight before its tiles exist: at least its rows, in whole
        tiles, plus the base tile (the CPU path counts its real tiles)."""
        return (math.ceil(num_tokens / self.side**2) + 1) * self.side**2

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        counts = [item.cost_tokens // self.side**2 for item in batch]  # each image's tiles
        out = []
        with torch.inference_mode():
            tiles = self.module.tiles(inputs["pixel_values"])
            for item, image_tiles in zip(batch, torch.split(tiles, counts), strict=True):
                packed = self.module.pack(image_tiles, torch.tensor(item.meta["image_sizes"], device=self.device))
                if packed.shape[0] != item.num_tokens:  # the count and the packing are two copies of one rule
                    raise RuntimeError(f"packed {packed.shape[0]} rows, counted {item.num_tokens}")
                out.append(to_encoded(self._to_host(packed)))
        return out


def _check(config: Any, *, onevision: bool) -> None:
    """Refuse what vLLM would compute otherwise: tiles whose rows are not the patch grid (a tower with
    a CLS token under the ``full`` strategy), several feature layers, OneVision's packing aspect."""
    vision = config.vision_config
    tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
    rows = tokens + (1 if vision.model_type.startswith("clip") else 0)
    rows -= 1 if config.vision_feature_select_strategy == "default" else 0
    if rows != tokens:
        raise ValueError(
            f"a {vision.model_type} tower under the {config.vision_feature_select_strategy!r} strategy gives {rows} "
            f"rows a tile, not its {tokens} patches: the tiles cannot be laid out as a grid"
        )
    if not isinstance(config.vision_feature_layer, int):
        raise ValueError(f"vision_feature_layer {config.vision_feature_layer}: only one layer is served")
    if onevision and getattr(config, "vision_aspect_ratio", ASPECT) != ASPECT:
        raise ValueError(f"vision_aspect_ratio {config.vision_aspect_ratio}: vLLM 0.32 packs with {ASPECT} only")


def _load(files: CheckpointFiles, config: Any, processor: Any, spec: LoadSpec, *, onevision: bool) -> AnyresEncoder:
    if spec.output not in OUTPUTS:
        raise ValueError(f"a LLaVA-NeXT/OneVision model's output is its projected features ({OUTPUTS}), "
                         f"not {spec.output!r}")
    _check(config, onevision=onevision)
    module = empty_module(lambda: AnyresVision(config, spec.dtype, onevision=onevision), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return AnyresEncoder(module, processor, spec, digest)


def load_llava_next(files: CheckpointFiles, config: Any, processor: Any, spec: LoadSpec) -> AnyresEncoder:
    """The LLaVA-NeXT adapter: the tower, the projector and ``image_newline``; the language model never read."""
    return _load(files, config, processor, spec, onevision=False)


def load_llava_onevision(files: CheckpointFiles, config: Any, processor: Any, spec: LoadSpec) -> AnyresEncoder:
    """The LLaVA-OneVision adapter: as LLaVA-NeXT's, with OneVision's packing."""
    return _load(files, config, processor, spec, onevision=True)


# vLLM 0.32's llava_next.py and llava_onevision.py parsers declare no embedding fields (LLaVA-OneVision-2's
# does): the prefill request carries the image and the uuid.
NEXT = Family(
    name="llava_next",
    model_types=("llava_next",),
    load=load_llava_next,
    epd=Epd("pixels_uuid", vllm_model="llava_next.py"),
)
ONEVISION = Family(
    name="llava_onevision",
    model_types=("llava_onevision",),
    load=load_llava_onevision,
    epd=Epd("pixels_uuid", vllm_model="llava_onevision.py"),
)
