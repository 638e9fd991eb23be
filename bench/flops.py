"""A Qwen2.5-VL request's compute, counted from its configs: how much of it is the vision tower's.

The end-to-end benchmark (``bench/epd_system.py``) runs small random checkpoints, so what it shows
carries over to a real deployment only if its tower takes the real model's share of a request's
work. This module counts multiply-adds (2 FLOPs each) of every matrix product and attention score
in a Qwen2.5-VL forward pass, from the same config fields a Hub ``config.json`` has, and states
the share for a workload: its images' sizes, its prompts' text lengths and its output lengths.

What is counted: the tower's patch embedding, blocks (windowed or full attention, the gated MLP)
and patch merger; the language model's projections, causal attention, gated MLP and head, over
the prefill (every prompt token, one logit row) and each decoded token. Norms, rotary embeddings
and activations are left out (a fraction of a percent at these widths). No cache is assumed: the
share is of the work a request needs when nothing is reused.

Pure arithmetic, no torch: the bench and its unit test (tests/unit/bench/test_flops.py) use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["QWEN2_5_VL_7B", "Request", "grid", "request_flops", "text_flops", "tower_share", "vision_flops"]

# Qwen/Qwen2.5-VL-7B-Instruct's config.json on the Hub (the fields counted here).
QWEN2_5_VL_7B: dict[str, dict[str, Any]] = {
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3,
    },
    "text_config": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064,
    },
}
MIN_PIXELS = 56 * 56
MAX_PIXELS = 12_845_056  # Qwen2.5-VL's processor default (its preprocessor_config.json)


@dataclass(frozen=True)
class Request:
    """One request of a workload: its image's size, its prompt's text tokens and its output tokens."""

    width: int
    height: int
    text_tokens: int
    output_tokens: int


def grid(width: int, height: int, patch: int = 14, merge: int = 2, min_pixels: int = MIN_PIXELS,
         max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The patch grid (rows, columns) Qwen's processor gives an image: both sides rounded to a
    multiple of ``patch * merge``, the area kept within the pixel bounds (``smart_resize``)."""
    factor = patch * merge
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h // patch, w // patch


def _window_sizes(rows: int, cols: int, merge: int, window_merged: int) -> list[int]:
    """Patches per attention window: the merged grid cut into ``window_merged``-square windows."""
    mr, mc = rows // merge, cols // merge
    sizes = []
    for r0 in range(0, mr, window_merged):
        for c0 in range(0, mc, window_merged):
            sizes.append(min(window_merged, mr - r0) * min(window_merged, mc - c0) * merge * merge)
    return sizes


def vision_flops(vision: Mapping[str, Any], rows: int, cols: int) -> float:
    """FLOPs of the tower on one image of ``rows`` x ``cols`` patches."""
    d, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    merge, patch = vision.get("spatial_merge_size", 2), vision.get("patch_size", 14)
    out = vision.get("out_hidden_size", d)
    n = rows * cols
    flops = 2.0 * n * vision.get("in_chans", 3) * vision.get("temporal_patch_size", 2) * patch * patch * d
    per_patch_linear = 2.0 * (4 * d * d + 3 * d * inter)  # qkv + proj, gate + up + down
    window_merged = max(1, vision.get("window_size", 112) // patch // merge)
    windows = _window_sizes(rows, cols, merge, window_merged)
    full = set(vision.get("fullatt_block_indexes", []))
    for layer in range(depth):
        flops += n * per_patch_linear
        spans = [n] if layer in full else windows
        flops += sum(4.0 * s * s * d for s in spans)  # QK^T and AV over each span
    merged, wide = n // (merge * merge), d * merge * merge
    flops += 2.0 * merged * (wide * wide + wide * out)
    return flops


def text_flops(text: Mapping[str, Any], prompt_tokens: int, output_tokens: int) -> float:
    """FLOPs of the language model: a prefill of ``prompt_tokens`` then ``output_tokens`` decode steps."""
    d, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    kv = d // text["num_attention_heads"] * text["num_key_value_heads"]
    per_token = layers * 2.0 * (2 * d * d + 2 * d * kv + 3 * d * inter)
    head = 2.0 * d * text["vocab_size"]
    prefill = prompt_tokens * per_token + layers * 4.0 * d * prompt_tokens * (prompt_tokens + 1) / 2 + head
    decode = 0.0
    for j in range(output_tokens - 1):  # the first token comes with the prefill's logits
        decode += per_token + layers * 4.0 * d * (prompt_tokens + j + 1) + head
    return prefill + decode


def request_flops(config: Mapping[str, Mapping[str, Any]], request: Request,
                  max_pixels: int = MAX_PIXELS) -> tuple[float, float]:
    """(tower FLOPs, language-model FLOPs) of one request with one image."""
    vision = config["vision_config"]
    merge = vision.get("spatial_merge_size", 2)
    rows, cols = grid(request.width, request.height, vision.get("patch_size", 14), merge, max_pixels=max_pixels)
    image_tokens = rows * cols // (merge * merge)
    prompt = request.text_tokens + image_tokens + 2  # the vision start and end markers
    return vision_flops(vision, rows, cols), text_flops(config["text_config"], prompt, request.output_tokens)


def tower_share(config: Mapping[str, Mapping[str, Any]], requests: Sequence[Request],
                max_pixels: int = MAX_PIXELS) -> float:
    """The tower's share of the workload's compute: tower FLOPs over all FLOPs, summed over requests."""
    tower = lm = 0.0
    for r in requests:
        t, m = request_flops(config, r, max_pixels)
        tower, lm = tower + t, lm + m
    return tower / (tower + lm)
