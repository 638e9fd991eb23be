"""Vision encoders: the only package that imports torch and transformers.

``load_encoder`` turns ``--model`` (a local directory, a hub id, or ``builtin:tiny``) into a
``VisionEncoder``, picking the adapter from the checkpoint's ``config.json`` ``model_type``. Every
adapter holds only the vision tower (and projector): a VLM's language model is never read.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (this package is where torch is first imported): idle
# OpenMP threads sleep instead of spinning. Spinning workers burnt 4x the CPU of the work itself
# (8.0 s against 2.1 s for 48 images on 2 cores, bench/serving.py's tiny tower) and took the
# cores from the threads that decode and preprocess the next batch. An operator's own
# OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json

from transformers import AutoConfig, AutoImageProcessor

from . import clip, gemma3, glm4v, internvl, llava, llava_next, mistral3, qwen, siglip2
from .base import EncodedTensor, EncoderInfo, PreparedImage, VisionEncoder
from .builtin import BUILTIN_MODELS, load_builtin
from .family import Epd, Family, by_model_type
from .hf import LoadSpec, resolve_device, resolve_dtype
from .loading import CheckpointFiles

__all__ = [
    "BUILTIN_MODELS",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "EncodedTensor",
    "EncoderInfo",
    "Epd",
    "Family",
    "PreparedImage",
    "VisionEncoder",
    "load_encoder",
]

# Every family the server serves: adding one is its module (ending with its FAMILY, or several) and a line here.
FAMILIES: tuple[Family, ...] = (
    clip.FAMILY, siglip2.FAMILY, llava.FAMILY, qwen.FAMILY, internvl.FAMILY, gemma3.FAMILY, mistral3.FAMILY,
    glm4v.FAMILY, llava_next.NEXT, llava_next.ONEVISION,
)
_BY_MODEL_TYPE = by_model_type(FAMILIES)
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


def load_encoder(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    output: str = "hidden",
    revision: str | None = None,
) -> VisionEncoder:
    """Load ``model``'s vision encoder, ready for ``preprocess``/``forward``.

    ``device``: ``auto`` (CUDA if present, else CPU) or a torch device string. ``dtype``: ``auto``
    (bfloat16 on CUDA, float32 on CPU), ``float32``, ``bfloat16`` or ``float16``. ``output``:
    ``hidden`` or ``pooled`` for CLIP/SigLIP; a VLM has one output (LLaVA ``projected``, Qwen
    ``merged``), which ``hidden``, the default, selects. ``revision``: a hub branch, tag or commit.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if model.startswith("builtin:"):
        encoder = load_builtin(LoadSpec(model, revision, torch_device, torch_dtype, output))
        encoder.family = qwen.FAMILY
        return encoder
    files = CheckpointFiles.resolve(model, revision)
    config_file = files.directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model} has no config.json")
    model_type = json.loads(config_file.read_text()).get("model_type")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(
            f"{model}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = AutoConfig.from_pretrained(files.directory)
    processor = AutoImageProcessor.from_pretrained(files.directory)
    spec = LoadSpec(model, files.revision or revision, torch_device, torch_dtype, output)
    encoder = family.load(files, config, processor, spec)
    encoder.family = family
    return encoder
