"""tests/gpu: the batched preprocessing path (``encoders/batched.py``) against the CPU path.

They need torchvision with its image extension, which the server's venv does not have: `make
test-gpu-path` (part of `make test`) runs them in the GPU rehearsal environment
(``scripts/gpu_rehearsal_env.sh``: the lent GPU machine's torch stack, on this machine's CPU), and
``bench/gpu_check.sh`` runs them on the GPU machine itself, where ``cuda`` joins ``cpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import tiny_models

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        "qwen2_5_vl": tiny_models.make_qwen2_5_vl(root / "qwen"),
        "clip": tiny_models.make_clip(root / "clip"),
        "siglip": tiny_models.make_clip(root / "siglip", kind="siglip"),
        "siglip2": tiny_models.make_clip(root / "siglip2", kind="siglip2"),
        "llava": tiny_models.make_llava(root / "llava"),
    }
