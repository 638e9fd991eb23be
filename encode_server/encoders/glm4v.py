"""GLM-4.1V: a Qwen2.5-VL-like tower (dynamic resolution, ``image_grid_thw``), so N follows the image.

The processor resizes to multiples of ``patch_size * merge_size`` (28 px) within its pixel budget
by GLM's own ``smart_resize``, which rounds to the nearest multiple and counts the budget over the
2-frame temporal patch (``size`` is ``{"shortest_edge": min, "longest_edge": max}`` in pixels x
frames). The tower adds learned position embeddings (interpolated to the grid), downsamples 2 x 2
by a strided convolution and runs its merger MLP: ``Glm4vModel.get_image_features``, t*h*w / 4
rows, what vLLM's ``glm4_1v.py`` returns from ``embed_multimodal``, with
``{"image_grid_thw": [t, h, w]}`` as meta. Batching is the Qwen adapter's.

vLLM 0.32 does not take GLM-4.1V pixel-free (its parser declares no embedding fields): the
prefill request carries the image and the uuid.
"""

from __future__ import annotations

from typing import Any

from transformers import Glm4vConfig
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize
from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

from .family import Epd, Family
from .hf import LoadSpec
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .qwen import QwenVisionEncoder

__all__ = ["FAMILY", "Glm4vEncoder", "load_glm4v"]

OUTPUTS = ("hidden", "merged")  # "hidden" is accepted as the default and means "merged"

# transformers 5's save_pretrained writes ``model.visual.*``; the hub's checkpoints ``model.visual.*`` too
# (older exports: ``visual.*``).
LAYOUTS: list[Layout] = [{"model.visual.": ""}, {"visual.": ""}]


class Glm4vEncoder(QwenVisionEncoder):
    """The Qwen adapter with GLM's resize rule for ``count_tokens``."""

    graphs_allowed = False  # its position embedding is resampled from the grid inside the forward

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's own rule (GLM's ``smart_resize`` for one image), not the model."""
        if self.processor.do_resize:
            size, temporal = self.processor.size, int(self.processor.temporal_patch_size)
            height, width = smart_resize(
                num_frames=temporal,
                height=height,
                width=width,
                temporal_factor=temporal,
                factor=self.patch_size * self.merge_size,
                min_pixels=size["shortest_edge"],
                max_pixels=size["longest_edge"],
            )
        grid = [1, height // self.patch_size, width // self.patch_size]
        return grid[1] * grid[2] // self.merge_size**2, {"image_grid_thw": grid}


def load_glm4v(files: CheckpointFiles, config: Glm4vConfig, processor: Any, spec: LoadSpec) -> Glm4vEncoder:
    """The GLM-4.1V adapter: ``config.vision_config``'s tower only, from ``(model.)visual.*``."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a GLM-4.1V model's output is its merged features ({OUTPUTS}), not {spec.output!r}")
    vision = config.vision_config
    module = empty_module(lambda: Glm4vVisionModel._from_config(vision, dtype=spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Glm4vEncoder(module, processor, spec, kind="glm4v", digest=digest)


FAMILY = Family(
    name="glm4v",
    model_types=("glm4v",),
    load=load_glm4v,
    epd=Epd("pixels_uuid", vllm_model="glm4_1v.py"),
)
