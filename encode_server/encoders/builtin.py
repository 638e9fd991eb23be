"""``builtin:tiny``: a seeded, random, Qwen2.5-VL-style vision tower, so the server starts anywhere.

It runs the real dynamic-resolution path (windowed and full attention, 2D rotary positions, the
2x2 patch merger, variable N with ``image_grid_thw``), small enough for a CPU: 2 blocks of width
64, 128-dim output, images held to at most 448*448 pixels (<= 1024 patches, <= 256 tokens).

The weights come from ``torch.manual_seed`` on the CPU in float32, in a forked RNG so the caller's
random state is untouched: every process that loads it holds bit-identical weights, hence the same
``weights_digest``. Its embeddings are deterministic and meaningless (``info.meaningless``).
"""

from __future__ import annotations

import torch
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from .hf import LoadSpec, processor_config
from .loading import empty_module, weights_digest
from .qwen import OUTPUTS, VIDEO_DEFAULTS, QwenVisionEncoder, as_patch_linear, attach_video

__all__ = ["BUILTIN_MODELS", "load_builtin"]

BUILTIN_MODELS = ("builtin:tiny",)
SEED = 0


def _config() -> Qwen2_5_VLVisionConfig:
    return Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=128,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],
    )


def _processor() -> Qwen2VLImageProcessorPil:
    """The PIL backend always, so that every install preprocesses (and fingerprints) alike."""
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448}, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def _seeded_weights() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(_config(), dtype=torch.float32)
    return reference.state_dict()


def load_builtin(spec: LoadSpec) -> QwenVisionEncoder:
    """A built-in model by name (``spec.model_id``), on ``spec.device`` in ``spec.dtype``.

    The seeded float32 weights are loaded into a module built the way checkpoint models are, so a
    lower-precision ``dtype`` rounds the weights but not the rotary buffers, as for a real model.
    """
    if spec.model_id not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {spec.model_id!r}; built-ins: {list(BUILTIN_MODELS)}")
    if spec.output not in OUTPUTS:
        raise ValueError(f"{spec.model_id}'s output is its merged features ({OUTPUTS}), not {spec.output!r}")
    state = _seeded_weights()
    config = _config()
    module = as_patch_linear(
        empty_module(
            lambda: Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=spec.dtype),
            spec.device,
            spec.dtype,
        )
    )
    module.load_state_dict(state, strict=True)
    processor = _processor()
    encoder = QwenVisionEncoder(module, processor, spec, kind="qwen2_5_vl", digest=weights_digest(state),
                                meaningless=True)
    # Videos too, with the settings transformers builds a Qwen2-VL video processor from when a
    # checkpoint has only the image processor's (``preprocessor_config.json``).
    attach_video(encoder, processor_config(processor), VIDEO_DEFAULTS)
    return encoder
