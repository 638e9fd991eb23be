"""Checkpoints the benchmarks load through the real ``--model DIR`` path: real architectures built
from configs with a fixed seed (random weights, no download), ``save_pretrained`` to a directory.

Built once and kept under ``~/.cache/encode-server/bench/`` (a ViT-B/32 takes seconds to build and
350 MB to write), keyed by a digest of the config, so an edit to a config builds afresh.

- ``vitb32``: CLIP ViT-B/32's vision tower (12 layers, width 768, 224 px, patch 32: 50 tokens).
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

__all__ = ["CONFIGS", "cache_dir", "model_dir"]

CONFIGS: dict[str, dict[str, Any]] = {
    "vitb32": {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "image_size": 224, "patch_size": 32, "projection_dim": 512,
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
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = CLIPVisionModel(CLIPVisionConfig(**config)).eval()
    model.save_pretrained(tmp)
    size = config["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
