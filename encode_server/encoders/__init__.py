"""Vision encoders: the only package that imports torch and transformers.

``load_encoder`` turns ``--model`` (a local directory, a hub id, or ``builtin:tiny``) into a
``Encoder``, picking the adapter from the checkpoint's ``config.json`` ``model_type``. Every
adapter holds only the vision tower (and projector): a VLM's language model is never read.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (this package is where torch is first imported): idle
# OpenMP threads sleep instead of spinning. Spinning workers burn CPU the work does not need and
# take the cores from the threads that decode and preprocess the next batch; and every thread that
# runs torch has its own OpenMP team, so with libgomp's default their spins fight over the cores.
# It costs a lone small pass its wake-ups. The figures: docs/benchmarks.md, "What each change
# bought". An operator's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import logging
from typing import Any

from transformers import AutoConfig, AutoImageProcessor

from . import (
    clip,
    gemma3,
    gemma4,
    glm4v,
    internvl,
    kimi_k25,
    llama4,
    llava,
    llava_next,
    mistral3,
    qwen,
    qwen2_5_omni,
    qwen2_audio,
    qwen3_omni,
    qwen3_vl,
    siglip2,
)
from .base import EncodedTensor, Encoder, EncoderInfo, PreparedItem
from .batched import BatchedPipeline
from .builtin import BUILTIN_MODELS, load_builtin
from .family import Epd, Family, by_model_type
from .hf import DTYPES, HFEncoder, LoadSpec, checkpoint_dtype, resolve_device, resolve_dtype
from .loading import CheckpointFiles, check_local_model
from .zero import ZERO_MODELS, load_zero

__all__ = [
    "BUILTIN_MODELS",
    "FAMILIES",
    "PREPROCESS_DEVICES",
    "SUPPORTED_MODEL_TYPES",
    "EncodedTensor",
    "Encoder",
    "EncoderInfo",
    "Epd",
    "Family",
    "PreparedItem",
    "check_local_model",
    "load_encoder",
]

log = logging.getLogger(__name__)

# Every family the server serves: adding one is its module (ending with its FAMILY, or several) and a line here.
FAMILIES: tuple[Family, ...] = (
    clip.FAMILY, siglip2.FAMILY, llava.FAMILY, qwen.FAMILY, qwen3_vl.FAMILY, internvl.FAMILY, gemma3.FAMILY,
    gemma4.FAMILY, mistral3.FAMILY, glm4v.FAMILY, llava_next.NEXT, llava_next.ONEVISION, qwen2_audio.FAMILY,
    llama4.FAMILY, qwen2_5_omni.FAMILY, qwen3_omni.FAMILY, kimi_k25.FAMILY,
)
_BY_MODEL_TYPE = by_model_type(FAMILIES)
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


PREPROCESS_DEVICES = ("auto", "cpu", "model")


def load_encoder(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    output: str = "hidden",
    revision: str | None = None,
    preprocess_device: str = "cpu",
    cuda_graph_tokens: int = 0,
) -> Encoder:
    """Load ``model``'s vision encoder, ready for ``preprocess``/``forward``.

    ``device``: ``auto`` (CUDA if present, else CPU) or a torch device string. ``dtype``: ``auto``
    (for a family with an EPD contract, what vLLM 0.32's ``auto`` picks for the checkpoint and
    device, since a vLLM prefill consumes its embeddings; otherwise bfloat16 on CUDA, float32 on
    the CPU: ``hf.resolve_dtype``; ``encoder.dtype_reason`` says why), ``float32``, ``bfloat16``
    or ``float16``. ``output``:
    ``hidden`` or ``pooled`` for CLIP/SigLIP; a VLM has one output (LLaVA ``projected``, Qwen
    ``merged``), which ``hidden``, the default, selects. ``revision``: a hub branch, tag or commit.
    ``preprocess_device``: ``cpu`` (Pillow decodes and the image processor runs per image, in the
    preprocessing threads), ``model`` (whole batches decoded and preprocessed on the model's
    device with torchvision: ``encoders/batched.py``), or ``auto``: ``model`` on CUDA for a family
    without an EPD contract, else ``cpu``. A family a vLLM prefill consumes keeps Pillow's decode,
    which is vLLM's: on an H200 nvJPEG put a tiny Qwen tower's embeddings 2.2% (relative L2) from
    the CPU path's, for no server throughput on Qwen2.5-VL-7B's tower (docs/benchmarks.md#gpu).
    ``cuda_graph_tokens``: the largest token budget of the tower's CUDA graphs (0: none), where the
    device and family take them (``cuda_graphs.py``); the warm-up captures them.
    """
    if preprocess_device not in PREPROCESS_DEVICES:
        raise ValueError(f"preprocess_device must be one of {PREPROCESS_DEVICES}, not {preprocess_device!r}")
    torch_device = resolve_device(device)
    encoder = _load(model, revision, dtype, torch_device, output)
    contract = encoder.family is not None and encoder.family.epd is not None
    on_device = preprocess_device == "model" or (preprocess_device == "auto" and torch_device.type == "cuda"
                                                 and not contract)
    if on_device:
        if not isinstance(encoder, HFEncoder):
            raise ValueError(f"{model} cannot preprocess on its device")
        try:
            encoder.use_batched(BatchedPipeline(encoder.processor, torch_device))
        except ImportError as exc:
            if preprocess_device == "model":
                raise ValueError(f"preprocessing on the model's device needs torchvision: {exc}") from exc
            log.warning("torchvision is not importable (%s): images are preprocessed on the CPU", exc)
    if cuda_graph_tokens > 0:
        encoder.use_graphs(cuda_graph_tokens)
    return encoder


def _load(model: str, revision: str | None, dtype: str, torch_device: Any, output: str) -> Encoder:
    if model in ZERO_MODELS:  # its rows' dtype is the towers' it stands for, unless asked otherwise
        zero = load_zero(model, torch_device, "bfloat16" if dtype == "auto" else dtype)
        zero.dtype_reason = ("the rows of the bfloat16 towers it stands for" if dtype == "auto"
                             else f"--dtype {dtype}")
        return zero
    if model.startswith("builtin:"):
        choice = resolve_dtype(dtype, torch_device)
        encoder = load_builtin(LoadSpec(model, revision, torch_device, DTYPES[choice.dtype], output))
        encoder.family = qwen.FAMILY
        encoder.dtype_reason = choice.reason
        return encoder
    files = CheckpointFiles.resolve(model, revision)
    config_file = files.directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{model} has no config.json")
    raw_config = json.loads(config_file.read_text())
    model_type = raw_config.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(
            f"{model}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if family.epd is not None:  # a vLLM prefill consumes these embeddings: its auto decides
        found, source = checkpoint_dtype(files.directory, raw_config)
        choice = resolve_dtype(dtype, torch_device, checkpoint=found, source=source, model_type=str(model_type))
    else:
        choice = resolve_dtype(dtype, torch_device, family=family.name)
    config = AutoConfig.from_pretrained(files.directory)
    processor = (family.processor or AutoImageProcessor.from_pretrained)(files.directory)
    spec = LoadSpec(model, files.revision or revision, torch_device, DTYPES[choice.dtype], output)
    encoder = family.load(files, config, processor, spec)
    encoder.family = family
    encoder.dtype_reason = choice.reason
    return encoder
