"""Qwen2-VL and Qwen2.5-VL: dynamic resolution, so N follows each image's size.

The processor resizes each image to multiples of ``patch_size * merge_size`` within its pixel
budget and cuts it into a ``t x h x w`` grid of patches (``t`` = 1 for a still image). The vision
transformer attends within each image and the merger folds every ``merge_size**2`` neighbouring
patches into one token in the language model's hidden size. The output is those merged features,
exactly ``get_image_features``' per-image split: N = t*h*w / merge_size**2 rows, with
``{"image_grid_thw": [t, h, w]}`` as meta because the LLM's M-RoPE positions need the grid.

A batch is the images' patch rows concatenated, with their grids stacked: the model keeps the
images apart by their cumulative sequence lengths, and the output is split back by each N.

The patch embedding is a Conv3d whose kernel equals its stride: one matrix product over each
patch's 3 x t x p x p values. It is computed as that product (``PatchLinear``), as vLLM's own
``Conv3dLayer`` does, rather than as a convolution: on a CPU a bfloat16 Conv3d took 55 of a
6-block tower's 142 ms for a 640x480 image (measured, one thread), and the result differs from
the convolution's only by float rounding (2e-5 of the largest value in float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from .base import EncodedTensor, PreparedImage
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "PatchLinear", "QwenVisionEncoder", "as_patch_linear", "load_qwen", "vision_model_class"]

OUTPUTS = ("hidden", "merged")  # "hidden" is accepted as the default and means "merged"

# ``model.visual.*``: current transformers module names, found in some re-saved checkpoints;
# ``visual.*``: the hub's original checkpoints, and what transformers 5's ``save_pretrained`` writes.
LAYOUTS: list[Layout] = [{"model.visual.": ""}, {"visual.": ""}]

_VISION_MODELS: dict[str, type[torch.nn.Module]] = {
    "qwen2_vl": Qwen2VisionTransformerPretrainedModel,
    "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
}


class PatchLinear(torch.nn.Module):
    """A stride-equals-kernel Conv3d as the matmul it is, on the same ``weight`` parameter (so the
    state dict, the weights digest and loading are unchanged). Input ``[L, C, t, p, p]``, output
    ``[L, out, 1, 1, 1]``: what the convolution returns, for the patch embedding's ``view``."""

    def __init__(self, conv: torch.nn.Conv3d) -> None:
        super().__init__()
        if conv.kernel_size != conv.stride or any(conv.padding) or conv.groups != 1 or conv.bias is not None:
            raise ValueError(f"not a patch projection: {conv}")
        self.weight = conv.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.reshape(x.shape[0], -1), self.weight.view(self.weight.shape[0], -1))
        return out.view(*out.shape, 1, 1, 1)


def as_patch_linear(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its patch embedding's Conv3d replaced by ``PatchLinear`` (in place)."""
    embed = module.get_submodule("patch_embed")
    if isinstance(embed.proj, torch.nn.Conv3d):
        embed.proj = PatchLinear(embed.proj)
    return module


def vision_model_class(kind: str) -> Any:
    """The vision transformer class of a Qwen VL ``model_type``."""
    return _VISION_MODELS[kind]


class QwenVisionEncoder(HFEncoder):
    """A Qwen2(.5)-VL vision transformer with its patch merger; variable N, grid in the meta.

    ``cost_tokens`` is t*h*w, the patch tokens the transformer attends over (merging comes last),
    which is what a batch's compute and activation memory grow with.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        processor: Any,
        spec: LoadSpec,
        *,
        kind: str,
        digest: str,
        meaningless: bool = False,
    ) -> None:
        merger_linears = [m for m in module.get_submodule("merger").modules() if isinstance(m, torch.nn.Linear)]
        super().__init__(
            module,
            processor,
            spec,
            kind=kind,
            output="merged",
            hidden_size=merger_linears[-1].out_features,
            weights_digest=digest,
            meaningless=meaningless,
        )
        config: Any = module.config
        self.merge_size = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        if (processor.patch_size, processor.merge_size) != (self.patch_size, self.merge_size):
            raise ValueError(
                f"image processor patch/merge size ({processor.patch_size}, {processor.merge_size}) does not "
                f"match the vision model's ({self.patch_size}, {self.merge_size})"
            )

    def preprocess(self, image: Image.Image) -> PreparedImage:
        inputs = self._process(image)
        grid = [int(x) for x in inputs["image_grid_thw"][0]]
        patches = grid[0] * grid[1] * grid[2]
        return PreparedImage(
            inputs={"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]},
            num_tokens=patches // self.merge_size**2,
            cost_tokens=patches,
            meta={"image_grid_thw": grid},
        )

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's own resize rule (``smart_resize`` within its min/max pixels), not the model."""
        if self.processor.do_resize:
            size = self.processor.size
            height, width = smart_resize(
                height,
                width,
                factor=self.patch_size * self.merge_size,
                min_pixels=size["shortest_edge"],
                max_pixels=size["longest_edge"],
            )
        grid = [1, height // self.patch_size, width // self.patch_size]
        return grid[1] * grid[2] // self.merge_size**2, {"image_grid_thw": grid}

    def forward(self, batch: Sequence[PreparedImage]) -> list[EncodedTensor]:
        if not batch:
            return []
        pixel_values = self._to_device([item.inputs["pixel_values"] for item in batch])
        grid_thw = self._to_device([item.inputs["image_grid_thw"] for item in batch], cast=False)
        with torch.inference_mode():
            merged = self.module(pixel_values, grid_thw=grid_thw).pooler_output.to("cpu")
        return [to_encoded(rows) for rows in torch.split(merged, [item.num_tokens for item in batch])]


def load_qwen(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> QwenVisionEncoder:
    """The Qwen VL adapter: just ``config.vision_config``'s transformer, from ``(model.)visual.*``."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Qwen VL model's output is its merged features ({OUTPUTS}), not {spec.output!r}")
    cls = vision_model_class(config.model_type)
    vision = config.vision_config
    module = as_patch_linear(empty_module(lambda: cls._from_config(vision, dtype=spec.dtype), spec.device, spec.dtype))
    digest = load_vision_weights(module, files, LAYOUTS)
    return QwenVisionEncoder(module, processor, spec, kind=config.model_type, digest=digest)


# vLLM 0.32's Qwen2-VL multimodal parser declares image_grid_thw as the embedding field of an image
# (vllm/model_executor/models/qwen2_vl.py; Qwen2.5-VL uses it too), so a prefill worker takes an
# image as metadata + uuid, and can run without its tower.
FAMILY = Family(
    name="qwen2_vl",
    model_types=tuple(_VISION_MODELS),
    load=load_qwen,
    epd=Epd("pixel_free", {"image": ("image_grid_thw",)}, vllm_model="qwen2_vl.py, qwen2_5_vl.py"),
)
