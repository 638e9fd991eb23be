"""Gemma 3: a SigLIP tower at one resolution, average-pooled to ``mm_tokens_per_image`` rows.

Every image is resized to the tower's square size (896 px for the hub's checkpoints); SigLIP's last
hidden state (post-layernorm, no pooling head) is average-pooled from its patch grid to
``mm_tokens_per_image`` (256: 64 x 64 patches to 16 x 16), RMS-normed (Gemma's ``1 + weight``) and
projected into the language model's hidden size: ``Gemma3Model.get_image_features``, and what vLLM's
``gemma3_mm.py`` returns from ``embed_multimodal``. So N is fixed and a batch is stacked.

Pan-and-scan crops are off by default, as ``Gemma3Processor`` passes ``do_pan_and_scan=False`` at
call time over the saved attribute (and vLLM sizes its placeholder from the same merged default).
vLLM turns them on only per request (``mm_processor_kwargs``), and so does this family
(``SETTINGS``): an image wide or tall enough is then cut into 2 or more crops (``pan_and_scan_crops``,
the image processor's rule), each resized to the tower's size and encoded as an image of its own,
and its embedding is the whole image's rows, then each crop's: (1 + crops) x ``mm_tokens_per_image``,
what vLLM's ``_process_image_input`` hands its language model for the item.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import Gemma3Config, Gemma3Processor, SiglipVisionModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from encode_server.core.settings import Setting

from .base import EncodedTensor, PreparedItem
from .clip import FixedResolutionEncoder
from .family import Epd, Family
from .hf import LoadSpec, apply_call_defaults, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "SETTINGS", "Gemma3Encoder", "Gemma3Vision", "load_gemma3", "pan_and_scan_crops"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# The hub's checkpoints (and vLLM's loader): ``vision_tower.vision_model.*`` and
# ``multi_modal_projector.*``, nested under ``model.`` when re-saved from the current module tree.
# transformers 5's SiglipVisionModel has no ``vision_model`` level (its save_pretrained drops it,
# and vLLM cannot load what it writes).
LAYOUTS: list[Layout] = [
    {"model.vision_tower.vision_model.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_tower.vision_model.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."},
]


class Gemma3Vision(torch.nn.Module):
    """``Gemma3Model`` without its language model (its attribute names, so its weight keys)."""

    def __init__(self, config: Gemma3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, rows an image, projector); the text model is never built
        self.vision_tower = SiglipVisionModel._from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """B x 3 x H x W -> B x mm_tokens_per_image x D."""
        return self.multi_modal_projector(self.vision_tower(pixel_values=pixel_values).last_hidden_state)


def pan_and_scan_crops(width: int, height: int, *, min_crop_size: int, max_num_crops: int, min_ratio: float) -> int:
    """The crops ``Gemma3ImageProcessor.pan_and_scan`` cuts a ``width`` x ``height`` image into (0:
    none), from its size alone, as vLLM's ``Gemma3ProcessingInfo.get_num_crops`` counts them: along
    the longer side only, when it is at least ``min_ratio`` times the other; about one crop per
    aspect ratio unit, 2 to ``max_num_crops`` of them, none if a crop would be under ``min_crop_size``."""
    long, short = max(width, height), min(width, height)
    if long / short < min_ratio:
        return 0
    crops = min(math.floor(long / min_crop_size), math.floor(long / short + 0.5))
    crops = min(max_num_crops, max(2, crops))
    if min(math.ceil(long / crops), short) < min_crop_size:
        return 0
    return crops


class Gemma3Encoder(FixedResolutionEncoder):
    """The pooled, projected image features; N is ``mm_tokens_per_image`` a crop (one crop: the
    whole image, unless a request turns pan-and-scan on)."""

    module: Gemma3Vision

    def __init__(self, module: Gemma3Vision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="gemma3",
            output="projected",
            hidden_size=int(module.multi_modal_projector.mm_input_projection_weight.shape[1]),
            weights_digest=digest,
        )
        vision: Any = module.config.vision_config
        self.cost_tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
        self.num_tokens = int(cast(Any, module.config).mm_tokens_per_image)

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.module(pixel_values)

    def setting_defaults(self) -> dict[str, Any]:
        """The pan-and-scan settings the processor is called with (``Gemma3Processor``'s call
        defaults, set on it at load; vLLM merges a request's over the same)."""
        p = self.processor
        return {"do_pan_and_scan": bool(p.do_pan_and_scan),
                "pan_and_scan_min_crop_size": int(p.pan_and_scan_min_crop_size),
                "pan_and_scan_max_num_crops": int(p.pan_and_scan_max_num_crops),
                "pan_and_scan_min_ratio_to_activate": float(p.pan_and_scan_min_ratio_to_activate)}

    def preprocess_with(self, image: Image.Image, settings: Mapping[str, Any]) -> PreparedItem:
        """The image processor called with the request's pan-and-scan settings, as vLLM's HF
        processor call passes them on: the whole image, then its crops."""
        inputs = self.processor(images=image, return_tensors="pt", **settings)
        num_tokens = (1 + int(inputs["num_crops"][0])) * self.num_tokens
        return PreparedItem({"pixel_values": inputs["pixel_values"]}, num_tokens, self.cost_of(num_tokens, {}))

    def count_tokens_with(self, width: int, height: int, settings: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        crops = 0
        if settings["do_pan_and_scan"]:
            crops = pan_and_scan_crops(width, height, min_crop_size=settings["pan_and_scan_min_crop_size"],
                                       max_num_crops=settings["pan_and_scan_max_num_crops"],
                                       min_ratio=settings["pan_and_scan_min_ratio_to_activate"])
        return (1 + crops) * self.num_tokens, {}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return num_tokens // self.num_tokens * self.cost_tokens

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        """Every crop of the batch in one pass; each item's rows are its crops' in order."""
        with torch.inference_mode():
            embeddings = self._to_host(self._embed(inputs["pixel_values"]))
        images = [item.num_tokens // self.num_tokens for item in batch]  # the whole image and its crops
        return [to_encoded(item.flatten(0, 1)) for item in torch.split(embeddings, images)]


def _check_processor(files: CheckpointFiles, config: Gemma3Config, processor: Any) -> None:
    """Refuse a processor that resizes to another size than the tower's, or whose ``image_seq_length``
    (vLLM's placeholder length) is not the rows the projector pools to."""
    vision: Any = config.vision_config
    size = [int(processor.size["height"]), int(processor.size["width"])]
    if size != [int(vision.image_size)] * 2:
        raise ValueError(f"image processor resizes to {size} px, the tower takes {vision.image_size} px")
    seq_length = files.processor_setting("image_seq_length")
    if seq_length is not None and int(seq_length) != int(cast(Any, config).mm_tokens_per_image):
        raise ValueError(
            f"processor_config.json image_seq_length {seq_length} != mm_tokens_per_image {config.mm_tokens_per_image}"
        )


def load_gemma3(files: CheckpointFiles, config: Gemma3Config, processor: Any, spec: LoadSpec) -> Gemma3Encoder:
    """The Gemma 3 adapter: SigLIP and the projector from the checkpoint, the language model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Gemma 3 model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    apply_call_defaults(processor, Gemma3Processor)  # do_pan_and_scan=False (see the module docstring)
    _check_processor(files, config, processor)
    module = empty_module(lambda: Gemma3Vision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Gemma3Encoder(module, processor, spec, digest)


# vLLM's per-request keys for a Gemma 3 image: pan-and-scan, which its gemma3_mm.py passes on to the
# HF processor (and counts crops by, get_num_crops). Each crop is one more image through the tower:
# never more crops than the checkpoint's processor allows by default (4 for the hub's).
SETTINGS = (
    Setting("do_pan_and_scan", "bool", "cut a wide or tall image into crops, each encoded as an image of its "
            "own after the whole image: more rows"),
    Setting("pan_and_scan_min_crop_size", "int", "the smallest crop side, in pixels (no crops below it)", minimum=1),
    Setting("pan_and_scan_max_num_crops", "int", "the most crops an image is cut into", minimum=1,
            ceiling="pan_and_scan_max_num_crops"),
    Setting("pan_and_scan_min_ratio_to_activate", "float", "the aspect ratio (long side / short side) from which "
            "an image is cut", above=0),
)

# vLLM 0.32's gemma3_mm.py takes pixels only (it asserts that no image_embeds come, and its parser
# declares no embedding fields): the prefill request carries the image and the uuid.
FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    load=load_gemma3,
    epd=Epd("pixels_uuid", vllm_model="gemma3_mm.py"),
    settings=SETTINGS,
)
