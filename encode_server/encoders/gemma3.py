"""Gemma 3: a SigLIP tower at one resolution, average-pooled to ``mm_tokens_per_image`` rows.

Every image is resized to the tower's square size (896 px for the hub's checkpoints); SigLIP's last
hidden state (post-layernorm, no pooling head) is average-pooled from its patch grid to
``mm_tokens_per_image`` (256: 64 x 64 patches to 16 x 16), RMS-normed (Gemma's ``1 + weight``) and
projected into the language model's hidden size: ``Gemma3Model.get_image_features``, and what vLLM's
``gemma3_mm.py`` returns from ``embed_multimodal``. So N is fixed and a batch is stacked.

Pan-and-scan crops are off, as ``Gemma3Processor`` passes ``do_pan_and_scan=False`` at call time
over the saved attribute (and vLLM sizes its placeholder from the same merged default); vLLM turns
them on only through per-request ``mm_processor_kwargs``, which this family does not declare (yet).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import Gemma3Config, Gemma3Processor, SiglipVisionModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from .clip import FixedResolutionEncoder
from .family import Epd, Family
from .hf import LoadSpec, apply_call_defaults
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "Gemma3Encoder", "Gemma3Vision", "load_gemma3"]

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


class Gemma3Encoder(FixedResolutionEncoder):
    """The pooled, projected image features; N is ``mm_tokens_per_image``."""

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


# vLLM 0.32's gemma3_mm.py takes pixels only (it asserts that no image_embeds come, and its parser
# declares no embedding fields): the prefill request carries the image and the uuid.
FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    load=load_gemma3,
    epd=Epd("pixels_uuid", vllm_model="gemma3_mm.py"),
)
