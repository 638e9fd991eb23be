"""Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE): Qwen2-VL's dynamic resolution, plus DeepStack.

The processor is Qwen2-VL's (``smart_resize`` to multiples of ``patch_size * merge_size``, here
16 * 2), so N and ``image_grid_thw`` follow each image's size exactly as in ``qwen.py``. The tower
differs: a learned position grid resampled to each image, and, in Qwen3-VL, DeepStack: the
hidden states after the blocks its vision config lists (read where ``encode_client.config_layout``,
the table the connector also reads, says) go through mergers of their own, and the language model
adds those rows into its first layers. vLLM's tower (``Qwen3_VisionTransformer.forward``) returns
them concatenated on the last dimension after the main merger's rows, ``[N, out_hidden_size *
(1 + levels)]``, and that wide tensor is what ``embed_multimodal`` returns, what its encoder cache
holds and what an EC connector moves (``_compute_deepstack_embeds`` splits it only when the
language model takes it). So that is our embedding, column for column. Qwen3.5's tower has no
DeepStack: its rows are the merger's.

The language model is never built or read: only ``(model.)visual.*``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from encode_client.config_layout import layout_of
from transformers import PretrainedConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from encode_server.core.sglang_wire import Extra, SglangContract
from encode_server.core.types import VideoInfo

from .base import VideoPlan
from .family import Epd, Family
from .hf import LoadSpec
from .loading import CheckpointFiles
from .qwen import PIXEL_SETTINGS, VIDEO_SETTINGS, QwenVisionEncoder, attach_video, load_vision_tower
from .qwen_video import VideoConfig, video_grid

__all__ = ["FAMILY", "Qwen3VisionEncoder", "deepstack_width", "load_qwen3"]

_VISION_MODELS: dict[str, type[torch.nn.Module]] = {
    "qwen3_vl": Qwen3VLVisionModel,
    "qwen3_vl_moe": Qwen3VLMoeVisionModel,
    "qwen3_5": Qwen3_5VisionModel,
    "qwen3_5_moe": Qwen3_5MoeVisionModel,
}


# Qwen3VLVideoProcessor's defaults (transformers 5), under what a checkpoint saves.
_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "fps": 2, "min_frames": 4, "max_frames": 768,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
}
# vLLM 0.32's Qwen3-VL video loader (vllm/multimodal/video.py, Qwen3VLVideoBackend): its own
# bounds, not the checkpoint's; the rate is the loader's fps (2 unless --media-io-kwargs says).
_LOADER_MIN_FRAMES, _LOADER_MAX_FRAMES, _LOADER_MAX_FPS, _UNKNOWN_FPS = 4, 768, 30, 24.0


def video_smart_resize(num_frames: int, height: int, width: int, config: VideoConfig) -> tuple[int, int]:
    """transformers' Qwen3-VL video ``smart_resize`` (the same in 5.19 and 5.24), with its optional
    per-frame pixel cap: the frame (height, width) for ``num_frames`` sampled frames."""
    factor, temporal = config.factor, config.temporal_patch_size
    max_pixels = config.max_pixels
    if config.cap_pixels_per_frame:
        per_frame = max(min(config.max_video_tokens * factor * factor, config.max_pixels // num_frames),
                        int(config.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if num_frames < temporal:
        raise ValueError(f"{num_frames} sampled frame(s): the model needs at least {temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if (ratio := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio:g}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def deepstack_width(vision: Any, kind: str) -> int:
    """A row's width as vLLM sizes its encoder output: ``out_hidden_size * (1 + levels)``, the
    DeepStack levels of ``vision`` (the tower's config) read where the layout table
    (``encode_client.config_layout``, which the connector reads too) says a ``kind`` keeps them."""
    return int(vision.out_hidden_size) * (1 + len(layout_of(kind).deepstack_levels(vision)))


class Qwen3VisionEncoder(QwenVisionEncoder):
    """A Qwen3-VL / Qwen3.5 vision tower: merged rows, then each DeepStack merger's, side by side.

    Videos: the frames vLLM's loader samples (``_sample``), resized and patched as
    ``Qwen3VLVideoProcessor`` does; ``meta`` carries ``video_grid_thw`` and ``timestamps`` (each
    temporal group's mid time in seconds, the ``<x.x seconds>`` text vLLM puts before its rows).
    """

    def __init__(self, module: torch.nn.Module, processor: Any, spec: LoadSpec, *, kind: str, digest: str,
                 meaningless: bool = False) -> None:
        super().__init__(module, processor, spec, kind=kind, digest=digest, meaningless=meaningless)
        self.info = replace(self.info, hidden_size=deepstack_width(module.config, kind))

    def _sample(self, info: VideoInfo, fps: float) -> list[int]:
        """vLLM's frame indices: ``int(frames / source_fps * fps)`` frames within [4, 768] and the
        video's own count, spread with ``linspace(...).round()``. When that takes every frame, vLLM
        hands them all to transformers, which samples again with the checkpoint's fps and frame
        bounds: so is it here."""
        assert self.video is not None
        total = info.num_frames
        source_fps = info.fps if info.fps > 0 else _UNKNOWN_FPS
        n = int(total / source_fps * min(fps, _LOADER_MAX_FPS))
        n = min(max(n, _LOADER_MIN_FRAMES), _LOADER_MAX_FRAMES, total)
        if n == total:
            n = int(total / source_fps * self.video.fps)
            n = min(max(n, self.video.min_frames), self.video.max_frames, total)
        return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]

    def plan_video(self, info: VideoInfo, fps: float) -> VideoPlan:
        if self.video is None:
            raise NotImplementedError("this checkpoint has no video processor config")
        indices = self._sample(info, fps)
        size = video_smart_resize(len(indices), info.height, info.width, self.video)
        if not self.video.do_resize:
            size = (info.height, info.width)
        tp = self.video.temporal_patch_size
        grid = video_grid(len(indices), size, self.video)
        padded = indices + [indices[-1]] * (-len(indices) % tp)
        source_fps = info.fps if info.fps > 0 else _UNKNOWN_FPS
        seconds = [i / source_fps for i in padded]
        timestamps = [(seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp)]
        return self._video_plan(info, indices, size, grid, {"video_grid_thw": grid, "timestamps": timestamps})

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **precomputed: Any) -> torch.Tensor:
        output = self.module(pixel_values, grid_thw=grid_thw, **precomputed)
        deepstack = list(getattr(output, "deepstack_features", None) or ())
        return torch.cat([output.pooler_output, *deepstack], dim=-1) if deepstack else output.pooler_output


def load_qwen3(files: CheckpointFiles, config: PretrainedConfig, processor: Any, spec: LoadSpec) -> Qwen3VisionEncoder:
    """The Qwen3 adapter: the vision transformer, its merger and its DeepStack mergers."""
    module, digest = load_vision_tower(_VISION_MODELS[config.model_type], files, config, spec)
    encoder = Qwen3VisionEncoder(module, processor, spec, kind=config.model_type, digest=digest)
    attach_video(encoder, files.video_processor_config(), _VIDEO_DEFAULTS)
    return encoder


# vLLM 0.32's Qwen3-VL multimodal parser (vllm/model_executor/models/qwen3_vl.py,
# Qwen3VLMultiModalDataParser; Qwen3.5 and the MoE models use Qwen3-VL's processing info) declares
# image_grid_thw for an image and video_grid_thw + timestamps for a video: each frame group's
# "<x.x seconds>" text sits in the placeholder, so the timestamps size it.
FAMILY = Family(
    name="qwen3_vl",
    model_types=tuple(_VISION_MODELS),
    load=load_qwen3,
    modalities=("image", "video"),
    epd=Epd(
        "pixel_free",
        {"image": ("image_grid_thw",), "video": ("video_grid_thw", "timestamps")},
        vllm_model="qwen3_vl.py, qwen3_vl_moe.py, qwen3_5.py",
    ),
    # Qwen2-VL's processing info's (vLLM's Qwen3VLProcessingInfo inherits it); a video's fps as its loader's
    settings=PIXEL_SETTINGS + VIDEO_SETTINGS,
    # SGLang's qwen_vl processor puts each frame group's "<t seconds>" in the prompt from video_timestamps.
    sglang=SglangContract(
        {"image": "image_grid_thw", "video": "video_grid_thw"},
        {"video": (Extra("video_timestamps", "timestamps", "list"),)},
        ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
         "Qwen3_5MoeForConditionalGeneration"),
    ),
)
