"""Qwen2-VL and Qwen2.5-VL: dynamic resolution, so N follows each image's size.

The processor resizes each image to multiples of ``patch_size * merge_size`` within its pixel
budget and cuts it into a ``t x h x w`` grid of patches (``t`` = 1 for a still image). The vision
transformer attends within each image and the merger folds every ``merge_size**2`` neighbouring
patches into one token in the language model's hidden size. The output is those merged features,
exactly ``get_image_features``' per-image split: N = t*h*w / merge_size**2 rows, with
``{"image_grid_thw": [t, h, w]}`` as meta because the LLM's M-RoPE positions need the grid.

A batch is the images' patch rows concatenated, with their grids stacked: the model keeps the
images apart by their cumulative sequence lengths, and the output is split back by each N.

Images are resized and normalised with torch, as transformers' torchvision-backend
``Qwen2VLImageProcessor`` does it (``qwen_video._pixels``: antialiased bicubic ``interpolate`` on
the uint8 image, then the fused rescale and normalisation), whatever backend this venv's
transformers picked. That is the processor vLLM runs (its environment has torchvision), so the
rows equal vLLM's tower's for resized images too; the PIL backend's bicubic resize rounds
differently and costs more CPU (docs/benchmarks.md, "What each change bought"). The fingerprint
names the torchvision class.

The patch embedding is a Conv3d whose kernel equals its stride: one matrix product over each
patch's 3 x t x p x p values. It is computed as that product (``PatchLinear``), as vLLM's own
``Conv3dLayer`` does, rather than as a convolution, which is slow on a CPU in bfloat16
(docs/benchmarks.md); the result differs from the convolution's only by float rounding.

Videos: one item of ``t`` temporal groups (two frames each), sampled as vLLM's loader for
``Qwen2VLVideoProcessor`` samples them (``Qwen2VLVideoBackend``: the server's ``--video-fps``, 4 to
768 frames, floored to whole groups), each frame resized by the image rule within the video
processor's pixel limits; ``meta`` carries ``video_grid_thw`` and, for Qwen2.5-VL,
``second_per_grid_ts`` (seconds per temporal group: what its M-RoPE temporal positions scale by).
vLLM 0.32's parser does not declare ``second_per_grid_ts`` (only ``video_grid_thw``) and assumes
1.0 s without it, but its Qwen2.5-VL processor takes it from a pixel-free item: with it, the
tokens equal vLLM's on the file; without, only when the sampling gives exactly 1.0 s per group
(docs/epd-families.md, ``tests/vllm/test_qwen25_video.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, cast

import numpy as np
import torch
from PIL import Image
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encode_server.core.settings import Setting
from encode_server.core.sglang_wire import Extra, SglangContract
from encode_server.core.types import VideoInfo

from .base import EncodedTensor, PreparedItem, VideoPlan
from .batched import torchvision_twin_name
from .cuda_graphs import TowerGraphs, budgets
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .qwen_video import VideoConfig, frames_nbytes, patchify, prepare_video, split_groups, video_grid
from .varlen import Grid, GridPlan, kernel_takes, segments, use_varlen

__all__ = [
    "FAMILY", "LAYOUTS", "PIXEL_SETTINGS", "VIDEO_DEFAULTS", "VIDEO_SETTINGS", "PatchLinear", "QwenVisionEncoder",
    "as_patch_linear", "attach_video", "load_qwen", "load_vision_tower", "video_frame_size", "vision_model_class",
]

OUTPUTS = ("hidden", "merged")  # "hidden" is accepted as the default and means "merged"

# ``model.visual.*``: current transformers module names, found in some re-saved checkpoints;
# ``visual.*``: the hub's original checkpoints, and what transformers 5's ``save_pretrained`` writes.
LAYOUTS: list[Layout] = [{"model.visual.": ""}, {"visual.": ""}]

_VISION_MODELS: dict[str, type[torch.nn.Module]] = {
    "qwen2_vl": Qwen2VisionTransformerPretrainedModel,
    "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
}

# Qwen2VLVideoProcessor's defaults (transformers 5.19 and 5.24), under what a checkpoint saves.
VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 768,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255, "max_video_tokens": 128000,
}
# vLLM 0.32's Qwen2-VL video loader (vllm/multimodal/video.py, Qwen2VLVideoBackend): its own frame
# bounds and temporal patch (not the checkpoint's); the rate is the loader's fps (2 unless
# --media-io-kwargs says).
_LOADER_MIN_FRAMES, _LOADER_MAX_FRAMES, _LOADER_MAX_FPS, _LOADER_TEMPORAL = 4, 768, 30, 2


def video_frame_size(num_frames: int, height: int, width: int, config: VideoConfig) -> tuple[int, int]:
    """Qwen2VLVideoProcessor's resize (transformers 5.19 and 5.24): the image rule on each frame,
    within the video's pixel limits, with its optional per-frame share of a whole-video budget."""
    max_pixels = config.max_pixels
    if config.cap_pixels_per_frame:
        total = int(config.max_video_tokens * config.factor * config.factor * 0.9)
        max_pixels = max(min(max_pixels, total * config.temporal_patch_size // num_frames),
                         int(config.min_pixels * 1.05))
    return smart_resize(height, width, factor=config.factor, min_pixels=config.min_pixels, max_pixels=max_pixels)


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

    ``video``: the video processor's settings (None: the checkpoint takes no video).
    """

    video: VideoConfig | None = None
    checked_meta = ("image_grid_thw",)  # the batched processor's grid must be the header's
    # Whether the tower's forward reads nothing of its grid but what the grid plan precomputes, so
    # that a CUDA graph with the plan's buffers replays it (GLM-4.1V's position embedding reads it).
    graphs_allowed: ClassVar[bool] = True
    graphs: TowerGraphs | None = None

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
        super().__init__(
            module,
            processor,
            spec,
            kind=kind,
            output="merged",
            hidden_size=self.output_width(module),
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
        # The image processor's settings, for the torch resize and normalisation (module docstring).
        self.image_pixels = VideoConfig(processor.to_dict(), defaults={})
        twin = torchvision_twin_name(processor)
        self.info = replace(self.info, preprocessing={**self.info.preprocessing, "processor_class": twin})
        use_varlen(module)
        self.grid_plan = self.make_grid_plan(module)

    def make_grid_plan(self, module: torch.nn.Module) -> GridPlan:
        """What the tower computes from the grids alone, made before each pass (``varlen.py``):
        its window layout where it has windows (Qwen2.5-VL: ``fullatt_block_indexes``), its learned
        position grid's resampling where it has one (Qwen3-VL: ``num_grid_per_side``)."""
        config: Any = module.config
        windows = None
        if getattr(config, "fullatt_block_indexes", None) is not None:
            windows = (int(config.window_size), int(config.patch_size))
        interpolation = None
        if hasattr(module, "num_grid_per_side"):
            interpolation = {"num_grid_per_side": int(cast(Any, module).num_grid_per_side),
                             "mode": getattr(module, "interpolation_mode", "bilinear"),
                             "align_corners": getattr(module, "interpolation_align_corners", True)}
        return GridPlan(self.merge_size, windows=windows, interpolation=interpolation)

    @staticmethod
    def output_width(module: torch.nn.Module) -> int:
        """D: the merger's output size (the language model's hidden size)."""
        merger_linears = [m for m in module.get_submodule("merger").modules() if isinstance(m, torch.nn.Linear)]
        return int(merger_linears[-1].out_features)

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **precomputed: Any) -> torch.Tensor:
        """The rows vLLM's ``embed_multimodal`` hands its language model, for a batch's patches
        (``precomputed``: the grid plan's keywords for the tower)."""
        return self.module(pixel_values, grid_thw=grid_thw, **precomputed).pooler_output

    def preprocess(self, image: Image.Image) -> PreparedItem:
        return self._pixels(image, self.count_tokens(image.width, image.height)[1])

    def setting_defaults(self) -> dict[str, Any]:
        """The image processor's pixel range, as vLLM reads it (``size``'s edges are its
        ``min_pixels``/``max_pixels``: ``Qwen2VLProcessingInfo._get_vision_size``)."""
        size = self.processor.size
        return {"min_pixels": int(size["shortest_edge"]), "max_pixels": int(size["longest_edge"])}

    def preprocess_with(self, image: Image.Image, settings: Mapping[str, Any]) -> PreparedItem:
        """The processor called as vLLM calls it with ``mm_processor_kwargs`` (``min_pixels`` and
        ``max_pixels`` completed into ``size``: ``_complete_mm_processor_size_aliases``)."""
        return self._pixels(image, self.count_tokens_with(image.width, image.height, settings)[1])

    def _pixels(self, image: Image.Image, meta: Mapping[str, Any]) -> PreparedItem:
        """The processor's ``pixel_values`` and grid for ``image`` resized to the grid its family's
        rule gave (``meta``), made as its torchvision backend makes them (a still image is one
        frame, repeated to fill its temporal patch, as the processor repeats it)."""
        _, grid_h, grid_w = meta["image_grid_thw"]
        size = (grid_h * self.patch_size, grid_w * self.patch_size)
        rows, grid = patchify(np.array(image)[None], size, self.image_pixels)
        return self._prepared({"pixel_values": rows, "image_grid_thw": torch.tensor([grid])})

    def count_tokens_with(self, width: int, height: int, settings: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return self._count(width, height, settings["min_pixels"], settings["max_pixels"])

    def _prepared(self, inputs: dict[str, torch.Tensor]) -> PreparedItem:
        grid = [int(x) for x in inputs["image_grid_thw"][0]]
        patches = grid[0] * grid[1] * grid[2]
        return PreparedItem(
            inputs={"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]},
            num_tokens=patches // self.merge_size**2,
            cost_tokens=patches,
            meta={"image_grid_thw": grid},
        )

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """The processor's own resize rule (``smart_resize`` within its min/max pixels), not the model."""
        size = self.processor.size
        return self._count(width, height, size["shortest_edge"], size["longest_edge"])

    def _count(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, dict[str, Any]]:
        if self.processor.do_resize:
            height, width = smart_resize(
                height, width, factor=self.patch_size * self.merge_size, min_pixels=min_pixels, max_pixels=max_pixels
            )
        grid = [1, height // self.patch_size, width // self.patch_size]
        return grid[1] * grid[2] // self.merge_size**2, {"image_grid_thw": grid}

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        t, h, w = meta.get("image_grid_thw") or meta["video_grid_thw"]
        return int(t * h * w)

    def _sample(self, info: VideoInfo, fps: float) -> list[int]:
        """vLLM's frame indices (``Qwen2VLVideoBackend``, a port of transformers' fps sampling):
        ``frames / source_fps * fps`` within [4, 768] and the video's own count, floored to whole
        groups of two, at ``torch.arange(0, total, total / n)``. vLLM then hands exactly these frames
        to the processor (``do_sample_frames`` is false for Qwen2-VL's)."""
        total = info.num_frames
        max_frames = min(_LOADER_MAX_FRAMES, total) // _LOADER_TEMPORAL * _LOADER_TEMPORAL
        n = total / info.fps * min(fps, _LOADER_MAX_FPS)
        n = math.floor(min(max(n, _LOADER_MIN_FRAMES), max_frames, total) / _LOADER_TEMPORAL) * _LOADER_TEMPORAL
        if n < _LOADER_TEMPORAL:
            raise ValueError(f"{total} frame(s): the model needs at least {_LOADER_TEMPORAL}")
        indices = torch.arange(0, total, total / n).int().clamp(max=total - 1)
        return [int(i) for i in indices]

    def plan_video(self, info: VideoInfo, fps: float) -> VideoPlan:
        if self.video is None:
            raise NotImplementedError("this checkpoint has no video processor config")
        indices = self._sample(info, fps)
        size = (info.height, info.width)
        if self.video.do_resize:
            size = video_frame_size(len(indices), info.height, info.width, self.video)
        grid = video_grid(len(indices), size, self.video)
        meta: dict[str, Any] = {"video_grid_thw": grid}
        if self.info.kind == "qwen2_5_vl":
            # Qwen2_5_VLProcessor: temporal_patch_size / the sampled rate (frames kept / frames * fps).
            meta["second_per_grid_ts"] = self.video.temporal_patch_size / (len(indices) / info.num_frames * info.fps)
        return self._video_plan(info, indices, size, grid, meta)

    def _video_plan(
        self, info: VideoInfo, indices: list[int], size: tuple[int, int], grid: list[int], meta: dict[str, Any]
    ) -> VideoPlan:
        """The plan from the sampled frames and their grid: rows, cost and the memory charge, as
        both Qwen video families (this one and Qwen3-VL's) count them."""
        assert self.video is not None
        patches = grid[0] * grid[1] * grid[2]
        nbytes = frames_nbytes(len(indices), info.height, info.width, size, self.video)
        return VideoPlan(tuple(indices), size, patches // self.merge_size**2, patches, nbytes, meta)

    def preprocess_video(self, frames: Any, plan: VideoPlan) -> PreparedItem:
        assert self.video is not None
        return prepare_video(frames, plan, self.video)

    def split(self, prepared: PreparedItem, max_cost: int) -> list[PreparedItem]:
        return split_groups(prepared, max_cost, self.merge_size)

    @staticmethod
    def grids(batch: Sequence[PreparedItem]) -> list[tuple[int, int, int]]:
        """The batch's grids in pass order, from the host: the CPU-made grid tensor, or the meta the
        header gave (the batched path's items, whose grid is checked against it)."""
        out: list[tuple[int, int, int]] = []
        for item in batch:
            grid = item.inputs.get("image_grid_thw")
            # numpy's tolist: a host tensor's values, read without a torch op (nothing to wait for)
            rows = grid.numpy().tolist() if grid is not None else [item.meta["image_grid_thw"]]
            out += [(int(t), int(h), int(w)) for t, h, w in rows]
        return out

    def use_graphs(self, max_tokens: int) -> bool:
        """CUDA graphs on CUDA in half precision (the varlen kernel's), for a family that allows
        them, with transformers' precomputed inputs (``cuda_graphs.py``)."""
        sizes = budgets(max_tokens, unit=self.merge_size**2)
        head_dim = int(getattr(self.module.get_submodule("blocks.0.attn"), "head_dim", 0))
        if (self.device.type != "cuda" or not kernel_takes(self.device, self.dtype, head_dim) or not sizes
                or not self.graphs_allowed or not self.grid_plan.supported):
            return False
        weight = cast(Any, self.module.get_submodule("patch_embed")).proj.weight
        self.graphs = TowerGraphs(self.features, self.grid_plan, device=self.device, dtype=self.dtype,
                                  width=math.prod(weight.shape[1:]), sizes=sizes)
        return True

    def capture_graphs(self) -> str | None:
        if self.graphs is None:
            return None
        sizes = ", ".join(map(str, self.graphs.sizes))
        try:
            held = self.graphs.capture()
        except RuntimeError as exc:  # an op this torch cannot capture: the eager forward still serves
            self.graphs = None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"CUDA graphs not captured ({type(exc).__name__}: {first}): the forward runs eagerly"
        return f"CUDA graphs at {len(self.graphs.sizes)} budgets ({sizes} patch rows): {held / 2**20:.0f} MiB"

    def tower_pass(self, pixels: torch.Tensor, grids: Sequence[Grid], grid_thw: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The pass run eagerly, its grid plan made first (``grid_thw``: the grids as a tensor on
        the device where the caller has it; the tower reads it only where it has no plan)."""
        plan = self.grid_plan.inputs(grids, self.device)
        if grid_thw is None:
            grid_thw = torch.tensor(grids, dtype=torch.int64).to(self.device, non_blocking=True)
        with segments(plan.layouts):
            return self.features(pixels, grid_thw, **plan.kwargs)

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        grids = self.grids(batch)
        with torch.inference_mode():
            if self.graphs is not None:
                merged = self.graphs.run(inputs["pixel_values"], grids, self.tower_pass)
            else:
                merged = self.tower_pass(inputs["pixel_values"], grids, inputs["image_grid_thw"])
        merged = self._to_host(merged)
        return [to_encoded(rows) for rows in torch.split(merged, [item.num_tokens for item in batch])]


def load_vision_tower(cls: Any, files: CheckpointFiles, config: PretrainedConfig, spec: LoadSpec) -> tuple[Any, str]:
    """Just ``config.vision_config``'s transformer (``cls``), filled from ``(model.)visual.*``; its digest."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Qwen VL model's output is its merged features ({OUTPUTS}), not {spec.output!r}")
    vision = config.vision_config
    module = empty_module(lambda: cls._from_config(vision, dtype=spec.dtype), spec.device, spec.dtype)
    return module, load_vision_weights(module, files, LAYOUTS)


def load_qwen(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> QwenVisionEncoder:
    """The Qwen2(.5)-VL adapter: the vision transformer and its merger, nothing of the language model.
    Its bias-free patch Conv3d runs as ``PatchLinear`` (same weight; Qwen3's has a bias: kept)."""
    module, digest = load_vision_tower(vision_model_class(config.model_type), files, config, spec)
    as_patch_linear(module)
    encoder = QwenVisionEncoder(module, processor, spec, kind=config.model_type, digest=digest)
    attach_video(encoder, files.video_processor_config(or_image_config=True), VIDEO_DEFAULTS)
    return encoder


def attach_video(encoder: QwenVisionEncoder, saved: dict[str, Any] | None, defaults: dict[str, Any]) -> None:
    """The video processor's settings on ``encoder``, checked against its tower; they change a
    video's tokens, so they join what the fingerprint covers. No settings: no video."""
    if saved is None:
        return
    encoder.video = VideoConfig(saved, defaults=defaults)
    if (encoder.video.patch_size, encoder.video.merge_size) != (encoder.patch_size, encoder.merge_size):
        raise ValueError("the video processor's patch/merge size does not match the vision model's")
    encoder.info = replace(encoder.info, preprocessing={**encoder.info.preprocessing, "video_processor": saved})


# vLLM 0.32's Qwen2-VL multimodal parser (vllm/model_executor/models/qwen2_vl.py,
# Qwen2VLMultiModalDataParser; Qwen2.5-VL uses it too) declares image_grid_thw as the embedding
# field of an image and video_grid_thw of a video, so a prefill worker takes either as metadata +
# uuid, and can run without its tower. It declares no second_per_grid_ts, which Qwen2.5-VL's
# processor takes (field config) and M-RoPE scales a video's time by: meta carries it, and the
# proxy sends it as a tensor string (vLLM's chat parser refuses it as a JSON array), float32 as
# vLLM's processor computes it from a file. Qwen2-VL's meta has none.
# vLLM's per-request keys for a Qwen2-VL / Qwen2.5-VL image (its HF processor's ``size`` edges;
# ``qwen2_vl.py``'s ``_get_vision_size``), bounded by --max-image-pixels and by the checkpoint's own
# max_pixels: a request trades detail for fewer tokens, never asks the tower for a larger grid than
# the warm-up ran (a 1-pixel image under min_pixels = 40M would be 200k patches).
PIXEL_SETTINGS = (
    Setting("min_pixels", "int", "the fewest pixels an image is resized to (smart_resize's lower bound)",
            minimum=1, cap="max_image_pixels", ceiling="max_pixels"),
    Setting("max_pixels", "int", "the most pixels an image is resized to (smart_resize's upper bound): "
            "fewer tokens per image", minimum=1, cap="max_image_pixels", ceiling="max_pixels"),
)
# A video's sampling per request, as vLLM 0.32 takes it for every Qwen video family: the chat's
# media_io_kwargs.video.fps, which its loader (Qwen2VLVideoBackend, Qwen3VLVideoBackend in
# vllm/multimodal/video.py) samples at in place of the default 2 (min(fps, 30)); both loaders ignore
# num_frames, so it is not a key. Above 30 vLLM samples at 30: refused here rather than aliased.
# The frames sampled stay under --max-video-frames and --max-video-decoded-frames (a 413 naming
# the item) and are charged to the memory budget, as at the server's --video-fps.
VIDEO_SETTINGS = (
    Setting("fps", "float", "the frames per second a video is sampled at (vLLM's video loader), in place of "
            "--video-fps: more frames, more tokens", above=0, maximum=_LOADER_MAX_FPS, modalities=("video",),
            server_default="video_fps", vllm_field="media_io_kwargs.video"),
)

FAMILY = Family(
    name="qwen2_vl",
    model_types=tuple(_VISION_MODELS),
    load=load_qwen,
    modalities=("image", "video"),
    epd=Epd(
        "pixel_free",
        {"image": ("image_grid_thw",), "video": ("video_grid_thw",)},
        vllm_model="qwen2_vl.py, qwen2_5_vl.py",
        tensors={"video": {"second_per_grid_ts": "float32"}},
    ),
    settings=PIXEL_SETTINGS + VIDEO_SETTINGS,
    # SGLang's qwen_vl processor reads Qwen2.5-VL's seconds per temporal group (Qwen2-VL's meta has none).
    sglang=SglangContract(
        {"image": "image_grid_thw", "video": "video_grid_thw"},
        {"video": (Extra("second_per_grid_ts", "second_per_grid_ts", "float32"),)},
        ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    ),
)
