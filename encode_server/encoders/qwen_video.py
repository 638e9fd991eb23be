"""What Qwen2-VL-style video processors share: frames to normalised temporal patches, as transformers'
``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor`` lay them out, and a video's patch rows cut
into runs of whole temporal groups.

The layout: frames resized to one (height, width), rescaled and normalised, the last frame repeated
up to a multiple of ``temporal_patch_size``, then cut into ``[grid_t, gh/m, gw/m, m, m]`` patches
of ``C x temporal_patch x patch x patch`` values. The tower attends within each temporal group
(its ``cu_seqlens`` repeat ``h*w`` per group; the windows of Qwen2.5-VL lie within a group too), so
a run of groups encoded alone gives exactly those groups' rows: that is what lets a long video's
forward pass be split.

The pixels are made as transformers' video processors make them on the CPU. Those are
torchvision-backed (``TorchvisionBackend``), and the server does not ship torchvision; so the steps
are done here with torch, as torchvision's ``resize`` does them on a uint8 CPU tensor:
``torch.nn.functional.interpolate(uint8, mode="bicubic", align_corners=False, antialias=True)``,
the result still uint8 (torch's native uint8 kernel: no cast, clamp or rounding of ours). Then,
as ``rescale_and_normalize`` fuses them: float32, minus ``mean / rescale_factor``, divided by
``std / rescale_factor``. vLLM runs that processor, so a resized frame's values equal vLLM's
(tests/vllm/test_qwen3_vl.py). Images are made with the same operations (``qwen.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .base import PreparedItem, VideoPlan

__all__ = ["VideoConfig", "frames_nbytes", "patchify", "prepare_video", "split_groups", "video_grid"]


class VideoConfig:
    """A video processor's saved settings (``video_preprocessor_config.json`` or the nested form)."""

    def __init__(self, raw: Mapping[str, Any], *, defaults: Mapping[str, Any]) -> None:
        merged = {**defaults, **raw}
        self.raw = dict(raw)
        size: Mapping[str, Any] = merged.get("size") or {}
        self.min_pixels = int(merged.get("min_pixels") or size["shortest_edge"])
        self.max_pixels = int(merged.get("max_pixels") or size["longest_edge"])
        self.patch_size = int(merged["patch_size"])
        self.temporal_patch_size = int(merged["temporal_patch_size"])
        self.merge_size = int(merged["merge_size"])
        self.fps = float(merged.get("fps") or 2.0)
        self.min_frames = int(merged.get("min_frames", 4))
        self.max_frames = int(merged.get("max_frames", 768))
        self.do_resize = bool(merged.get("do_resize", True))
        self.do_rescale = bool(merged.get("do_rescale", True))
        self.do_normalize = bool(merged.get("do_normalize", True))
        self.rescale_factor = float(merged.get("rescale_factor", 1 / 255))
        self.mean = np.asarray(merged["image_mean"], dtype=np.float32)
        self.std = np.asarray(merged["image_std"], dtype=np.float32)
        self.cap_pixels_per_frame = bool(merged.get("cap_pixels_per_frame") or False)
        self.max_video_tokens = int(merged.get("max_video_tokens", 768))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _pixels(frames: np.ndarray, size: tuple[int, int], config: VideoConfig) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 to ``[T, C, h, w]`` float32 (contiguous): resized, rescaled,
    normalised, with the operations (and so the rounding) of transformers' torchvision backend."""
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)  # a view; interpolate takes channels-last
    if config.do_resize and tuple(video.shape[-2:]) != tuple(size):
        video = torch.nn.functional.interpolate(video, size=size, mode="bicubic", align_corners=False,
                                                antialias=True)
    out = video.to(torch.float32, memory_format=torch.contiguous_format)
    del video
    mean, std = torch.from_numpy(config.mean), torch.from_numpy(config.std)
    if config.do_rescale and config.do_normalize:  # fused, as _fuse_mean_std_and_rescale_factor does
        mean, std = mean * (1.0 / config.rescale_factor), std * (1.0 / config.rescale_factor)
    if config.do_normalize:
        out.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    elif config.do_rescale:
        out.mul_(config.rescale_factor)
    return out.numpy()


def patchify(frames: np.ndarray, size: tuple[int, int], config: VideoConfig) -> tuple[torch.Tensor, list[int]]:
    """Frames to the processor's ``pixel_values_videos`` rows and ``[grid_t, grid_h, grid_w]``."""
    video = _pixels(frames, size, config)
    tp, p, m = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -video.shape[0] % tp:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    t, c, h, w = video.shape
    gt, gh, gw = t // tp, h // p, w // p
    patches = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = np.ascontiguousarray(patches.reshape(gt * gh * gw, c * tp * p * p))
    return torch.from_numpy(rows), [gt, gh, gw]


def video_grid(num_frames: int, size: tuple[int, int], config: VideoConfig) -> list[int]:
    """``[grid_t, grid_h, grid_w]`` of ``num_frames`` sampled frames resized to ``size`` (height,
    width): the frames padded to whole temporal groups, as ``patchify`` pads them."""
    return [math.ceil(num_frames / config.temporal_patch_size), size[0] // config.patch_size,
            size[1] // config.patch_size]


def prepare_video(frames: np.ndarray, plan: VideoPlan, config: VideoConfig) -> PreparedItem:
    """Decoded frames (``plan.indices``) to the tower's inputs, checked against the plan's grid: the
    rows must fill the placeholder that ``/v1/tokens`` counted from the header."""
    rows, grid = patchify(frames, plan.size, config)
    if grid != plan.meta["video_grid_thw"]:
        raise ValueError(f"the decoded frames make a {grid} grid, the header a {plan.meta['video_grid_thw']} one")
    return PreparedItem(
        inputs={"pixel_values": rows, "image_grid_thw": torch.tensor([grid])},
        num_tokens=plan.num_tokens, cost_tokens=plan.cost_tokens, meta=plan.meta,
    )


def frames_nbytes(num_frames: int, height: int, width: int, size: tuple[int, int], config: VideoConfig) -> int:
    """Peak bytes of decoding and preprocessing one video: the decoded uint8 frames, their resized
    uint8 copy, and two float32 copies (the normalised frames, then the padded frames and the
    patch rows, each of whole temporal groups)."""
    padded = math.ceil(num_frames / config.temporal_patch_size) * config.temporal_patch_size
    resized = num_frames * size[0] * size[1] * 3
    return num_frames * height * width * 3 + resized + 2 * padded * size[0] * size[1] * 3 * 4


def split_groups(prepared: PreparedItem, max_cost: int, merge_size: int) -> list[PreparedItem]:
    """A video's prepared inputs cut into runs of whole temporal groups, each costing at most
    ``max_cost`` patch tokens (at least one group each); an image (one group) is not cut."""
    grid = [int(x) for x in prepared.inputs["image_grid_thw"][0]]
    groups, per_group = grid[0], grid[1] * grid[2]
    step = max(1, max_cost // per_group)
    if groups <= step:
        return [prepared]
    parts = []
    pixels = prepared.inputs["pixel_values"]
    for start in range(0, groups, step):
        count = min(step, groups - start)
        parts.append(
            PreparedItem(
                inputs={
                    "pixel_values": pixels[start * per_group : (start + count) * per_group],
                    "image_grid_thw": torch.tensor([[count, grid[1], grid[2]]]),
                },
                num_tokens=count * per_group // merge_size**2,
                cost_tokens=count * per_group,
                meta=prepared.meta,
            )
        )
    return parts
