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

import functools
import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPModel,
    Gemma3ForConditionalGeneration,
    Gemma4ForConditionalGeneration,
    Glm4vForConditionalGeneration,
    InternVLForConditionalGeneration,
    Kimi_K25ForConditionalGeneration,
    Llama4ForConditionalGeneration,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    Mistral3ForConditionalGeneration,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Siglip2Config,
    Siglip2ImageProcessorPil,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessorPil,
    SiglipModel,
)

from encode_server.encoders.qwen import as_patch_linear

__all__ = [
    "SEED",
    "load_full_model",
    "make_clip",
    "make_llava",
    "make_qwen2_5_vl",
    "make_qwen2_vl",
    "make_qwen3",
    "qwen_pixels",
    "reference_anyres_features",
    "reference_clip_features",
    "reference_gemma3_features",
    "reference_gemma4_features",
    "reference_internvl_features",
    "reference_kimi_k25_features",
    "reference_llama4_features",
    "reference_llava_features",
    "reference_mistral3_features",
    "reference_qwen3_features",
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
    """A full ``CLIPModel`` (``kind="clip"``) or ``SiglipModel`` (``kind="siglip"``): 32 px, 16 patches;
    or a NaFlex ``Siglip2Model`` (``kind="siglip2"``): 8 px patches, at most 24 per image."""
    torch.manual_seed(SEED)
    text = {**_TINY_TEXT, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    model: PreTrainedModel
    if kind == "clip":
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=_TINY_VIT, projection_dim=24))
        processor: Any = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    elif kind == "siglip":
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=_TINY_VIT))
        processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    elif kind == "siglip2":
        vision = {k: v for k, v in _TINY_VIT.items() if k != "image_size"}
        model = Siglip2Model(Siglip2Config(text_config=text, vision_config={**vision, "num_patches": 16}))
        processor = Siglip2ImageProcessorPil(patch_size=8, max_num_patches=24)
    else:
        raise ValueError(f"kind must be 'clip', 'siglip' or 'siglip2', not {kind!r}")
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


_TINY_QWEN_TEXT = {
    **_TINY_TEXT,
    "hidden_size": 48,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
}
_TINY_QWEN_TOKENS = {
    "image_token_id": 250,
    "video_token_id": 251,
    "vision_start_token_id": 252,
    "vision_end_token_id": 253,
}


def _qwen_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224}, patch_size=14, merge_size=2
    )


def make_qwen2_5_vl(directory: Path | str) -> Path:
    """A full ``Qwen2_5_VLForConditionalGeneration``: windowed + full-attention vision blocks, tiny LLM."""
    torch.manual_seed(SEED)
    vision = {
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
    }
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=_TINY_QWEN_TEXT, **_TINY_QWEN_TOKENS)
    return _save(Qwen2_5_VLForConditionalGeneration(config).eval(), _qwen_processor(), directory)


def make_qwen2_vl(directory: Path | str) -> Path:
    """A full ``Qwen2VLForConditionalGeneration`` (full attention in every block), tiny LLM."""
    torch.manual_seed(SEED)
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 48, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14}
    config = Qwen2VLConfig(vision_config=vision, text_config=_TINY_QWEN_TEXT, **_TINY_QWEN_TOKENS)
    return _save(Qwen2VLForConditionalGeneration(config).eval(), _qwen_processor(), directory)


def load_full_model(path: Path | str, *, conv_patch_embed: bool = False) -> PreTrainedModel:
    """The whole saved model, language model included, through HF's own ``from_pretrained``.

    Its tensors are then copied into fresh (aligned) memory: ``from_pretrained`` may leave them in
    the safetensors file's memory map at unaligned offsets, where CPU BLAS takes another kernel and
    rounds differently (~1e-7), which would hide a real mismatch among benign ones. A Qwen model's
    patch embedding runs as the matmul the server (and vLLM) computes it as, unless
    ``conv_patch_embed``: ``test_qwen.py`` checks that matmul against HF's own Conv3d.
    """
    model_type = AutoConfig.from_pretrained(path).model_type
    classes: dict[str, type[PreTrainedModel]] = {
        "internvl": InternVLForConditionalGeneration,
        "llama4": Llama4ForConditionalGeneration,
        "kimi_k25": Kimi_K25ForConditionalGeneration,
        "gemma3": Gemma3ForConditionalGeneration,
        "gemma4": Gemma4ForConditionalGeneration,
        "mistral3": Mistral3ForConditionalGeneration,
        "glm4v": Glm4vForConditionalGeneration,
        "llava_onevision": LlavaOnevisionForConditionalGeneration,
        "llava_next": LlavaNextForConditionalGeneration,
        "clip": CLIPModel,
        "siglip": SiglipModel,
        "siglip2": Siglip2Model,
        "llava": LlavaForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen2_vl": Qwen2VLForConditionalGeneration,
    }
    if model_type.startswith("qwen3"):
        from transformers import AutoModelForImageTextToText

        classes[model_type] = AutoModelForImageTextToText  # type: ignore[assignment]
    model = classes[model_type].from_pretrained(path, dtype=torch.float32).eval()
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    if model_type in ("qwen2_vl", "qwen2_5_vl") and not conv_patch_embed:  # Qwen3: a biased Conv3d, kept
        as_patch_linear(model.model.visual)
    return model


@functools.lru_cache(maxsize=4)
def _cached_full_model(path: str, mtime_ns: int) -> PreTrainedModel:
    return load_full_model(path)


def _reference_model(path: Path | str) -> Any:
    """``load_full_model(path)``, loaded once for the several images a test compares: the
    references only read it (never what is under test), and a tiny full model takes most of a
    second to load. Keyed by the checkpoint's config mtime too, so a rewritten checkpoint reloads;
    the last four are kept."""
    return _cached_full_model(*_checkpoint_key(path))


def _checkpoint_key(path: Path | str) -> tuple[str, int]:
    """A checkpoint directory's cache key: its resolved path and its config's mtime."""
    return str(Path(path).resolve()), (Path(path) / "config.json").stat().st_mtime_ns


def _inputs(path: Path | str, image: Image.Image) -> dict[str, torch.Tensor]:
    return dict(AutoImageProcessor.from_pretrained(path)(images=image, return_tensors="pt"))


@functools.lru_cache(maxsize=4)
def _cached_encoder(path: str, mtime_ns: int) -> Any:
    from encode_server.encoders import load_encoder

    return load_encoder(path, device="cpu", dtype="float32")


def qwen_pixels(path: Path | str, image: Image.Image) -> dict[str, torch.Tensor]:
    """The pixels a Qwen-style tower (Qwen2/2.5/3-VL, GLM-4.1V) is handed for ``image``: made by
    encode-server as transformers' torchvision-backend processor (the one vLLM runs) makes them.
    This venv has no torchvision, so its processor is the PIL one, which resizes otherwise; the
    pixels themselves are checked apart: against vLLM's processor exactly (tests/vllm), against
    this venv's up to its resize (tests/unit/encoders/test_qwen.py). The references below run the
    full model on them, so they check the tower, its weights and the split of its output."""
    return dict(_cached_encoder(*_checkpoint_key(path)).preprocess(image).inputs)


@torch.inference_mode()
def reference_clip_features(path: Path | str, image: Image.Image, output: str = "hidden") -> torch.Tensor:
    """The full CLIP/SigLIP(2) model's vision output for one image: N x D hidden or 1 x D pooled.

    For SigLIP2 NaFlex, ``hidden`` keeps the image's own patches, not the padding up to
    ``max_num_patches``.
    """
    model = _reference_model(path)
    inputs = _inputs(path, image)
    if isinstance(model, CLIPModel) and output == "pooled":
        return model.get_image_features(**inputs).pooler_output
    outputs = model.vision_model(**inputs)
    if output == "pooled":
        return outputs.pooler_output
    if "spatial_shapes" in inputs:
        return outputs.last_hidden_state[0, : int(inputs["spatial_shapes"][0].prod())]
    return outputs.last_hidden_state[0]


@torch.inference_mode()
def reference_llava_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``LlavaForConditionalGeneration.get_image_features`` for one image: N x D_llm."""
    model = _reference_model(path)
    pixel_values = _inputs(path, image)["pixel_values"]
    return model.get_image_features(pixel_values=pixel_values).pooler_output[0]


@torch.inference_mode()
def reference_qwen_features(path: Path | str, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    """``Qwen2(_5)_VLForConditionalGeneration.get_image_features`` for one image (``qwen_pixels``):
    (N x D_llm, [t, h, w])."""
    model = _reference_model(path)
    inputs = qwen_pixels(path, image)
    grid = inputs["image_grid_thw"]
    features = model.get_image_features(inputs["pixel_values"], grid).pooler_output[0]
    return features, grid[0].tolist()  # GLM-4.1V's get_image_features has the same signature


def make_qwen3(directory: Path | str, kind: str = "qwen3_vl", **kwargs: Any) -> Path:
    """A tiny Qwen3-VL / Qwen3.5 checkpoint (``tests/vllm/tiny_qwen3.py``, which vLLM's tests load too);
    MoE experts in transformers' own layout, so ``load_full_model`` reads it back."""
    from tests.vllm.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(directory, kind, hub_experts=False, **kwargs)  # type: ignore[arg-type]


@torch.inference_mode()
def reference_qwen3_features(path: Path | str, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    """What vLLM's Qwen3-VL ``embed_multimodal`` hands its language model for one image: the full
    model's ``get_image_features`` merged rows with each DeepStack merger's rows after them on the
    last dimension (Qwen3.5: the merged rows alone), for ``qwen_pixels``. (N x D * (1 + k), [t, h, w])."""
    model = _reference_model(path)
    inputs = qwen_pixels(path, image)
    grid = inputs["image_grid_thw"]
    output = model.get_image_features(inputs["pixel_values"], grid)
    deepstack = [features[0] for features in (getattr(output, "deepstack_features", None) or [])]
    return torch.cat([output.pooler_output[0], *deepstack], dim=-1), grid[0].tolist()


@torch.inference_mode()
def reference_internvl_features(path: Path | str, images: list[Image.Image]) -> list[torch.Tensor]:
    """``InternVLForConditionalGeneration.get_image_features`` for a batch of images, as vLLM calls it
    (last layer, CLS dropped, every image tiled as ``InternVLProcessor`` does): rows per image."""
    model = _reference_model(path)
    inputs = AutoImageProcessor.from_pretrained(path)(images=images, crop_to_patches=True, return_tensors="pt")
    features = model.get_image_features(
        inputs["pixel_values"], vision_feature_layer=-1, vision_feature_select_strategy="default"
    ).pooler_output
    return [tiles.flatten(0, 1) for tiles in torch.split(features, inputs["num_patches"].tolist())]


@torch.inference_mode()
def reference_llama4_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``Llama4ForConditionalGeneration.get_image_features`` for one image's tiles (global tile
    last), flattened as vLLM's ``embed_multimodal`` hands them on: rows x D_llm. The tiles are
    encode-server's: this venv has no torchvision, which Llama 4's only image processor needs; they
    are checked against that processor's, exactly, in tests/vllm/test_llama4_pixels.py."""
    model = _reference_model(path)
    tiles = _cached_encoder(*_checkpoint_key(path)).preprocess(image).inputs["pixel_values"]
    return model.get_image_features(tiles.float()).pooler_output.flatten(0, 1)


@torch.inference_mode()
def reference_kimi_k25_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``Kimi_K25Model.get_image_features`` for one image: rows x D_llm. transformers has no Kimi
    image processor to run here (vLLM's is numba's, checked against encode-server's patches in
    tests/vllm/test_kimi_k25_pixels.py), so the patches are encode-server's uint8 ones, normalised
    as transformers' Kimi processor does (``(x / 255 - mean) / std``); transformers loads the hub's
    fused, interleaved-RoPE weights through its own conversion."""
    model = _reference_model(path)
    prepared = _cached_encoder(*_checkpoint_key(path)).preprocess(image)
    media = json.loads((Path(path) / "preprocessor_config.json").read_text())["media_proc_cfg"]
    mean = torch.tensor(media["image_mean"]).view(1, 3, 1, 1)
    std = torch.tensor(media["image_std"]).view(1, 3, 1, 1)
    pixels = (prepared.inputs["patches"].float() / 255 - mean) / std
    grid = torch.tensor([prepared.meta["grid_thws"]])
    return model.model.get_image_features(pixels, grid).pooler_output[0]


@torch.inference_mode()
def reference_gemma3_features(path: Path | str, images: list[Image.Image]) -> torch.Tensor:
    """``Gemma3ForConditionalGeneration.get_image_features`` for a batch of images: B x N x D_llm."""
    model = _reference_model(path)
    pixel_values = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    return model.get_image_features(pixel_values).pooler_output


@torch.inference_mode()
def reference_gemma4_features(path: Path | str, images: list[Image.Image]) -> list[torch.Tensor]:
    """``Gemma4ForConditionalGeneration.get_image_features`` for a batch of images, with the
    patches and positions its image processor makes: each image's rows x D_llm."""
    model = _reference_model(path)
    inputs = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    return list(model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output)


@torch.inference_mode()
def reference_mistral3_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``Mistral3ForConditionalGeneration.get_image_features`` for one image, with the image processor
    called as ``PixtralProcessor`` calls it (patch size x merge size): rows x D_llm. (transformers
    5.24 fails on an image of one row: it squeezes the row dimension away.)"""
    model = _reference_model(path)
    merged = model.config.vision_config.patch_size * model.config.spatial_merge_size
    processor = AutoImageProcessor.from_pretrained(path)
    inputs = processor(images=image, patch_size={"height": merged, "width": merged}, return_tensors="pt")
    features = model.get_image_features(inputs["pixel_values"], inputs["image_sizes"], vision_feature_layer=-1)
    return features.pooler_output[0]


@torch.inference_mode()
def reference_anyres_features(path: Path | str, image: Image.Image) -> torch.Tensor:
    """``LlavaNextForConditionalGeneration`` / ``LlavaOnevisionForConditionalGeneration``
    ``.get_image_features`` for one image: its packed rows (base tile, unpadded grid, newline rows) x D_llm."""
    model = _reference_model(path)
    inputs = _inputs(path, image)
    return model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output[0]
