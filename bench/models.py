"""Checkpoints the benchmarks load through the real ``--model DIR`` path: real architectures built
from configs with a fixed seed (random weights, no download), ``save_pretrained`` to a directory.

Built once and kept under ``~/.cache/encode-server/bench/`` (a ViT-B/32 takes seconds to build and
350 MB to write), keyed by a digest of the config, so an edit to a config builds afresh.

- ``vitb32``: CLIP ViT-B/32's vision tower (12 layers, width 768, 224 px, patch 32: 50 tokens).
- ``qwen25_vl_7b_vision_dir``: Qwen2.5-VL-7B's vision tower (32 blocks of width 1280, merger to
  3,584) in bfloat16, inside a Qwen2.5-VL checkpoint whose language model is tiny (never read):
  what ``bench/gpu_check.sh`` serves.
- ``siglip_so400m_dir``: SigLIP so400m/14's vision tower at 384 px (27 layers of width 1152,
  729 tokens) in bfloat16, vision-only: the tower whose forward pass is short against its
  preprocessing, which ``bench/gpu_check.sh`` serves beside the Qwen one.
- ``clip``: a tiny CLIP tower (2 layers of width 64, 224 px, patch 16), served with ``--output
  pooled``: the model of an independent check of the miss path that S1's overhead now repeats.
- ``wide``: a one-layer CLIP tower of width 1024, so that its embeddings are N x 1024 as a
  ViT-L-class tower's are; S2 serves hits of 64, 576 and 2,500 tokens of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIGS", "QWEN25_VL_7B_VISION", "SIGLIP_SO400M_384", "cache_dir", "model_dir", "qwen25_vl_7b_vision_dir",
    "siglip_so400m_dir",
]

CONFIGS: dict[str, dict[str, Any]] = {
    "vitb32": {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "image_size": 224, "patch_size": 32, "projection_dim": 512,
    },
    "clip": {
        "with_projection": True,  # --output pooled is the projected embedding (visual_projection)
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "image_size": 224, "patch_size": 16, "projection_dim": 32,
    },
    "wide": {
        "hidden_size": 1024, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 16,
        "image_size": 224, "patch_size": 32, "projection_dim": 512,
    },
}
SEED = 0


def cache_dir() -> Path:
    root = os.environ.get("ENCODE_SERVER_CACHE") or Path.home() / ".cache" / "encode-server"
    return Path(root) / "bench"


def model_dir(name: str) -> Path:
    """The checkpoint directory of ``name``, built on first use."""
    config = CONFIGS[name]
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"{name}-{digest}"
    if (path / ".complete").exists():
        return path
    import torch
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    settings = {k: v for k, v in config.items() if k != "with_projection"}
    cls = CLIPVisionModelWithProjection if config.get("with_projection") else CLIPVisionModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = cls(CLIPVisionConfig(**settings)).eval()
    model.save_pretrained(tmp)
    size = config["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


QWEN25_VL_7B_VISION: dict[str, Any] = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "in_chans": 3,
}
_TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 1024, "max_position_embeddings": 512, "bos_token_id": 0,
    "eos_token_id": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
}


def qwen25_vl_7b_vision_dir(**overrides: Any) -> Path:
    """A Qwen2.5-VL checkpoint with the 7B model's vision tower (random weights, bf16);
    ``overrides`` change the vision config (a shallow copy for a CPU smoke test)."""
    vision = {**QWEN25_VL_7B_VISION, **overrides}
    digest = hashlib.sha256(json.dumps([vision, _TINY_TEXT], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"qwen25vl7b-vision-{digest}"
    if (path / ".complete").exists():
        return path
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = Qwen2_5_VLConfig(
        vision_config=vision, text_config=_TINY_TEXT, image_token_id=1000, video_token_id=1001,
        vision_start_token_id=1002, vision_end_token_id=1003,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(tmp)
    Qwen2VLImageProcessorPil().save_pretrained(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


SIGLIP_SO400M_384: dict[str, Any] = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "image_size": 384, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
}


def siglip_so400m_dir(**overrides: Any) -> Path:
    """A vision-only SigLIP checkpoint the size of so400m/14 at 384 px (random weights, bf16), with
    its processor (384 x 384, bicubic, mean and std 0.5); ``overrides`` shrink it off the GPU."""
    vision = {**SIGLIP_SO400M_384, **overrides}
    digest = hashlib.sha256(json.dumps(vision, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"siglip-so400m-384-{digest}"
    if (path / ".complete").exists():
        return path
    import torch
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = SiglipVisionModel._from_config(SiglipVisionConfig(**vision), dtype=torch.bfloat16).eval()
    model.save_pretrained(tmp)
    size = vision["image_size"]
    SiglipImageProcessorPil(size={"height": size, "width": size}, resample=3).save_pretrained(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
