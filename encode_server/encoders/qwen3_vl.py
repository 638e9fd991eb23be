"""Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): Qwen2-VL's dynamic resolution, plus DeepStack.

The processor is Qwen2-VL's (``smart_resize`` to multiples of ``patch_size * merge_size``, here
16 * 2), so N and ``image_grid_thw`` follow each image's size exactly as in ``qwen.py``. The tower
differs: a learned position grid resampled to each image, and, in Qwen3-VL, DeepStack: the
hidden states after the blocks in ``deepstack_visual_indexes`` go through mergers of their own,
and the language model adds those rows into its first layers. vLLM's tower
(``Qwen3_VisionTransformer.forward``) returns them concatenated on the last dimension after the
main merger's rows, ``[N, out_hidden_size * (1 + len(deepstack_visual_indexes))]``, and that wide
tensor is what ``embed_multimodal`` returns, what its encoder cache holds and what an EC connector
moves (``_compute_deepstack_embeds`` splits it only when the language model takes it). So that
is our embedding, column for column. Qwen3.5's tower has no DeepStack: its rows are the merger's.

The language model is never built or read: only ``(model.)visual.*``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from .family import Epd, Family
from .hf import LoadSpec
from .loading import CheckpointFiles
from .qwen import QwenVisionEncoder, load_vision_tower

__all__ = ["FAMILY", "Qwen3VisionEncoder", "load_qwen3"]

_VISION_MODELS: dict[str, type[torch.nn.Module]] = {
    "qwen3_vl": Qwen3VLVisionModel,
    "qwen3_vl_moe": Qwen3VLMoeVisionModel,
    "qwen3_5": Qwen3_5VisionModel,
    "qwen3_5_moe": Qwen3_5MoeVisionModel,
}


class Qwen3VisionEncoder(QwenVisionEncoder):
    """A Qwen3-VL / Qwen3.5 vision tower: merged rows, then each DeepStack merger's, side by side."""

    @staticmethod
    def output_width(module: torch.nn.Module) -> int:
        """``out_hidden_size * (1 + len(deepstack_visual_indexes))``, as vLLM sizes its encoder output."""
        config: Any = module.config
        return int(config.out_hidden_size) * (1 + len(getattr(config, "deepstack_visual_indexes", None) or ()))

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        output = self.module(pixel_values, grid_thw=grid_thw)
        deepstack = list(getattr(output, "deepstack_features", None) or ())
        return torch.cat([output.pooler_output, *deepstack], dim=-1) if deepstack else output.pooler_output


def load_qwen3(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> Qwen3VisionEncoder:
    """The Qwen3 adapter: the vision transformer, its merger and its DeepStack mergers."""
    module, digest = load_vision_tower(_VISION_MODELS[config.model_type], files, config, spec)
    encoder = Qwen3VisionEncoder(module, processor, spec, kind=config.model_type, digest=digest)
    # The video processor's settings (frame rate, frame and pixel limits) change a video's tokens:
    # they are part of what the fingerprint covers.
    video = files.video_processor_config()
    if video is not None:
        encoder.info = replace(encoder.info, preprocessing={**encoder.info.preprocessing, "video_processor": video})
    return encoder


# vLLM 0.32's Qwen3-VL multimodal parser (vllm/model_executor/models/qwen3_vl.py,
# Qwen3VLMultiModalDataParser; Qwen3.5 and the MoE models use Qwen3-VL's processing info) declares
# image_grid_thw for an image and video_grid_thw + timestamps for a video: each frame group's
# "<x.x seconds>" text sits in the placeholder, so the timestamps size it.
FAMILY = Family(
    name="qwen3_vl",
    model_types=tuple(_VISION_MODELS),
    load=load_qwen3,
    epd=Epd("pixel_free", {"image": ("image_grid_thw",)}, vllm_model="qwen3_vl.py, qwen3_vl_moe.py, qwen3_5.py"),
)
