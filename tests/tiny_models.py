"""Tiny, seeded Hugging Face checkpoints for tests: real architectures, a few layers, no download.

Each ``make_*`` builds a full model (vision tower, projector *and* language model where the family
has one) from a config under a fixed seed, ``save_pretrained``s it with its image processor into
``directory`` and returns that path, so that ``load_encoder(path)`` reads it as it would a hub
snapshot. The ``reference_*`` helpers run the full HF model's own code on the same inputs: the
ground truth an adapter must match bit for bit.

Typical use in a test::

    path = make_qwen2_5_vl(tmp_path)
    encoder = load_encoder(str(path), device="cpu")
    expected = reference_qwen_features(path, image)   # full model's get_image_features
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPModel,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    SiglipConfig,
    SiglipImageProcessorPil,
    SiglipModel,
)

__all__ = [
    "SEED",
    "load_full_model",
    "make_clip",
    "make_llava",
    "make_qwen2_5_vl",
    "reference_clip_features",
    "reference_llava_features",
    "reference_qwen_features",
]

SEED = 1234

_TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
_TINY_VIT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}


def _save(model: PreTrainedModel, processor: Any, directory: Path | str) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def make_clip(directory: Path | str, *, kind: str = "clip") -> Path:
    """A full ``CLIPModel`` (``kind="clip"``) or ``SiglipModel`` (``kind="siglip"``): 32 px, 16 patches."""
    torch.manual_seed(SEED)
    text = {**_TINY_TEXT, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    model: PreTrainedModel
    if kind == "clip":
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=_TINY_VIT, projection_dim=24))
        processor: Any = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    elif kind == "siglip":
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=_TINY_VIT))
        processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    else:
        raise ValueError(f"kind must be 'clip' or 'siglip', not {kind!r}")
    return _save(model.eval(), processor, directory)


def make_llava(directory: Path | str) -> Path:
    """A full ``LlavaForConditionalGeneration``: a tiny CLIP tower, the MLP projector and a tiny Llama."""
    torch.manual_seed(SEED)
    config = LlavaConfig(
        vision_config={"model_type": "clip_vision_model", **_TINY_VIT},
        text_config=LlamaConfig(**{**_TINY_TEXT, "hidden_size": 48, "num_key_value_heads": 1}),
        image_token_id=127,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return _save(model.eval(), processor, directory)


def make_qwen2_5_vl(directory: Path | str) -> Path:
    """A full ``Qwen2_5_VLForConditionalGeneration``: windowed + full-attention vision blocks, tiny LLM."""
    torch.manual_seed(SEED)
    config = Qwen2_5_VLConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 48,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        text_config={
            **_TINY_TEXT,
            "hidden_size": 48,
            "num_key_value_heads": 1,
            "vocab_size": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
        },
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224}, patch_size=14, merge_size=2
    )
    return _save(model.eval(), processor, directory)


def load_full_model(path: Path | str) -> PreTrainedModel:
    """The whole saved model, language model included, through HF's own ``from_pretrained``."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(path).model_type
    classes: dict[str, type[PreTrainedModel]] = {
        "clip": CLIPModel,
        "siglip": SiglipModel,
        "llava": LlavaForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    }
    return classes[model_type].from_pretrained(path, dtype=torch.float32).eval()


def _inputs(path: Path | str, image: Image.Image) -> dict[str, torch.Tensor]:
    return dict(AutoImageProcessor.from_pretrained(path)(images=image, return_tensors="pt"))


@torch.inference_mode()
def reference_clip_features(path: Path | str, image: Image.Image, output: str = "hidden") -> torch.Tensor:
    """The full CLIP/SigLIP model's vision output for one image: N x D hidden or 1 x D pooled."""
    model: Any = load_full_model(path)
    pixel_values = _inputs(path, image)["pixel_values"]
    if output == "hidden":
        return model.vision_model(pixel_values=pixel_values).last_hidden_state[0]
    if isinstance(model, CLIPModel):
        return model.get_image_features(pixel_values=pixel_values).pooler_output
    return model.vision_model(pixel_values=pixel_values).pooler_output


@torch.inference_mode()
def reference_llava_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``LlavaForConditionalGeneration.get_image_features`` for one image: N x D_llm."""
    model: Any = load_full_model(path)
    pixel_values = _inputs(path, image)["pixel_values"]
    return model.get_image_features(pixel_values=pixel_values).pooler_output[0]


@torch.inference_mode()
def reference_qwen_features(path: Path | str, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    """``Qwen2_5_VLForConditionalGeneration.get_image_features`` for one image: (N x D_llm, [t, h, w])."""
    model: Any = load_full_model(path)
    inputs = _inputs(path, image)
    grid = inputs["image_grid_thw"]
    features = model.get_image_features(inputs["pixel_values"], grid).pooler_output[0]
    return features, grid[0].tolist()
