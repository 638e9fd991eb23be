"""A tiny Qwen2.5-VL checkpoint that vLLM can load: weights, tokenizer, processor, chat template.

Built offline from configs under a fixed seed and ``save_pretrained``; nothing is downloaded.
Sized for vLLM's CPU build: text head size 32 (its attention needs 32, 64, 80 or more) with
``mrope_section`` summing to head_dim / 2; the vision tower has windowed and full-attention blocks
like the real one. The tokenizer is a word-level one with Qwen's special tokens, so prompts,
placeholders and greedy token ids work as with the real model (the words mean nothing).

``video``: a video processor config (``Qwen2VLVideoProcessor``'s saved form, ``VIDEO_PROCESSOR``
with overrides) is saved too, in the hub's ``video_preprocessor_config.json`` (``layout="hub"``) or
nested in ``processor_config.json`` as transformers 5 writes it (``"nested"``). Without one,
transformers (and the server) build the video processor from ``preprocessor_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

SEED = 4321
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_TEXT = (
    "user assistant system describe the image what is in this picture a an of and to it you are helpful "
    "cat dog red blue green sky tree house car person one two three four five six seven eight nine ten "
    "hello world please tell me about colour shape big small left right top bottom yes no"
)
WORDS = _TEXT.split(" ")
VOCAB_SIZE = 256
VIDEO_MIN_PIXELS = 56 * 56
VIDEO_MAX_PIXELS = 112 * 112

# Qwen2VLVideoProcessor's saved form (transformers 5.19; Qwen2.5-VL has no video processor of its
# own), with this checkpoint's sizes: frames of 56x56 to 112x112 pixels.
VIDEO_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "do_sample_frames": False, "fps": 2.0, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "max_frames": 768, "merge_size": 2, "min_frames": 4,
    "patch_size": 14, "resample": 3, "rescale_factor": 1 / 255, "return_metadata": False,
    "size": {"longest_edge": VIDEO_MAX_PIXELS, "shortest_edge": VIDEO_MIN_PIXELS}, "temporal_patch_size": 2,
    "video_processor_type": "Qwen2VLVideoProcessor",
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url', 'image_embeds') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_5_vl(
    directory: Path | str,
    *,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    vision: dict[str, Any] | None = None,
    dtype: str = "float32",
    video: dict[str, Any] | None = None,
    layout: Literal["nested", "hub"] = "hub",
    text: dict[str, Any] | None = None,
    init_std: float = 0.2,
) -> Path:
    """Save the checkpoint into ``directory`` and return it. ``vision`` overrides the tower's config
    (the benchmark's larger tower: ``bench/vllm_peer.py``); ``dtype`` is the dtype the weights are
    saved in (and the config's ``dtype``, which vLLM's ``auto`` follows); ``video`` overrides
    ``VIDEO_PROCESSOR`` and saves it (``{}``: as it is), in ``layout``. ``text`` overrides the
    language model's config (the tower's output width follows its ``hidden_size``); ``init_std`` is
    the weights' spread (the default makes greedy tokens depend visibly on the image; wider models
    need less to keep their activations finite)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    words = ["<unk>", *WORDS]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL) - len(words))]
    vocab = {w: i for i, w in enumerate(words + SPECIAL)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: vocab[t] for t in SPECIAL}

    torch.manual_seed(SEED)
    text_config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        **(text or {}),
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text_config["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        **(vision or {}),
    }
    config = Qwen2_5_VLConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    # Larger-than-default weights so that greedy tokens depend visibly on the image embedding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=14, merge_size=2
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if video is not None:
        # Written as JSON, not through Qwen2VLVideoProcessor: transformers' video processors need
        # torchvision, which the server's environment lacks (this builder runs in both).
        saved = {**VIDEO_PROCESSOR, **video}
        if layout == "hub":
            (path / "video_preprocessor_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
        else:
            nested = {"video_processor": saved, "processor_class": "Qwen2_5_VLProcessor"}
            (path / "processor_config.json").write_text(json.dumps(nested, indent=2, sort_keys=True))
    return path
