"""LLaVA-style VLMs: a CLIP/SigLIP tower, a feature layer picked from it, and the MLP projector.

The output is what ``LlavaForConditionalGeneration.get_image_features`` gives for one image: the
hidden states of ``vision_feature_layer`` (several layers concatenated when it is a list), the CLS
token dropped under the ``default`` select strategy, through ``multi_modal_projector``: N x D with
D the language model's hidden size, ready to splice into the prompt's embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModel, LlavaConfig
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from .clip import FixedResolutionEncoder
from .family import Epd, Family
from .hf import LoadSpec
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "LlavaEncoder", "LlavaVision", "load_llava"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# The hub's checkpoints (and vLLM's loader) keep CLIP's ``vision_model.`` level, which transformers
# 5's CLIPVisionModel and its ``save_pretrained`` do not have; newer transformers nest both parts
# under ``model.``. Most specific first (``loading._select``: the layout all of whose parts match).
LAYOUTS: list[Layout] = [
    {"model.vision_tower.vision_model.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_tower.vision_model.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."},
    {"model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."},
]


# Towers with one input size, hence a fixed N (``FixedResolutionEncoder``).
_FIXED_TOWERS = ("clip_vision_model", "siglip_vision_model")


class LlavaVision(torch.nn.Module):
    """``LlavaModel`` without its language model: same attribute names, hence the same weight keys."""

    def __init__(self, config: LlavaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (feature layer, strategy); the text model is never built
        self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layer: int | list[int] = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden_states = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        selected = [hidden_states[layer][:, 1:] if self.drop_cls else hidden_states[layer] for layer in layers]
        features = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.multi_modal_projector(features)


class LlavaEncoder(FixedResolutionEncoder):
    """The projected image features; N is the tower's token count, less CLS under ``default``."""

    module: LlavaVision

    def __init__(self, module: LlavaVision, processor: Any, spec: LoadSpec, digest: str) -> None:
        super().__init__(
            module,
            processor,
            spec,
            kind="llava",
            output="projected",
            hidden_size=module.multi_modal_projector.linear_2.out_features,
            weights_digest=digest,
        )
        tower: Any = module.vision_tower
        self.cost_tokens = int(tower.embeddings.num_positions)
        self.num_tokens = self.cost_tokens - 1 if module.drop_cls else self.cost_tokens

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.module(pixel_values)


def load_llava(files: CheckpointFiles, config: LlavaConfig, processor: Any, spec: LoadSpec) -> LlavaEncoder:
    """The LLaVA adapter: tower and projector from the checkpoint, the language model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a LLaVA model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    tower_type = getattr(config.vision_config, "model_type", None)
    if tower_type not in _FIXED_TOWERS:
        raise ValueError(
            f"{spec.model_id}: a LLaVA model with a {tower_type} tower (Pixtral-12B's HF format, for one) is not "
            f"served; this family takes fixed-resolution towers ({', '.join(_FIXED_TOWERS)})"
        )
    module = empty_module(lambda: LlavaVision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return LlavaEncoder(module, processor, spec, digest)


# vLLM 0.32's llava.py parser declares no embedding fields: the prefill request carries the image
# and the uuid.
FAMILY = Family(name="llava", model_types=("llava",), load=load_llava, epd=Epd("pixels_uuid", vllm_model="llava.py"))
