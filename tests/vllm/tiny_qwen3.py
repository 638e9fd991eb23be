"""Tiny Qwen3-VL (dense and MoE) and Qwen3.5 checkpoints that vLLM can load: weights, tokenizer,
image and video processors, chat template.

Built offline from configs under a fixed seed and ``save_pretrained``; nothing is downloaded.
Like ``tiny_qwen.py``: text head size 32 (vLLM's CPU attention needs 32, 64, 80 or more) with an
``mrope_section`` summing to head_dim / 2 (interleaved, as Qwen3-VL's), a word-level tokenizer with
Qwen's special tokens. The vision tower has the real one's shape: patch 16, spatial merge 2,
temporal patch 2, a learned position grid, and (Qwen3-VL) DeepStack mergers on two of its three
blocks, so an embedding row is ``out_hidden_size * 3`` wide.

``layout``: ``"nested"`` is what transformers 5 writes (``processor_config.json`` holding both
processor configs); ``"hub"`` is what hub checkpoints carry (``preprocessor_config.json`` and
``video_preprocessor_config.json``). The server must load both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from tests.vllm.tiny_qwen import CHAT_TEMPLATE, SPECIAL, VOCAB_SIZE, WORDS

SEED = 5432
MIN_PIXELS = 64 * 64
MAX_PIXELS = 256 * 256
VIDEO_MIN_PIXELS = 64 * 64
VIDEO_MAX_PIXELS = 2 * 8 * 128 * 128  # two temporal groups of eight 128x128 frames
DEEPSTACK = [0, 1]
OUT_HIDDEN = 64  # the vision out_hidden_size (= the text hidden size); a row is this x (1 + len(DEEPSTACK))

# Qwen3VLVideoProcessor's saved form (transformers 5.19), with this checkpoint's sizes.
VIDEO_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "do_sample_frames": True, "fps": 2.0, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "max_frames": 64, "max_video_tokens": 768, "merge_size": 2, "min_frames": 4, "patch_size": 16,
    "resample": 3, "rescale_factor": 1 / 255, "return_metadata": False,
    "size": {"longest_edge": VIDEO_MAX_PIXELS, "shortest_edge": VIDEO_MIN_PIXELS},
    "temporal_patch_size": 2, "video_processor_type": "Qwen3VLVideoProcessor",
}

Kind = Literal["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]

VIDEO_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% endif %}{% endfor %}{% endif %}",
    "{% elif part['type'] in ('video', 'video_url', 'video_embeds') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}",
)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", *WORDS, "seconds>", *(f"<{t / 10:.1f}" for t in range(0, 200))]
    words += [f"w{i}" for i in range(VOCAB_SIZE * 2 - len(SPECIAL) - len(words))]
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
    tokenizer.chat_template = VIDEO_TEMPLATE
    return tokenizer, vocab


def make_tiny_qwen3(
    directory: Path | str,
    kind: Kind = "qwen3_vl",
    *,
    layout: Literal["nested", "hub"] = "nested",
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    video: dict[str, Any] | None = None,
    hub_experts: bool = True,
) -> Path:
    """Save the checkpoint into ``directory`` and return it; ``video`` overrides video processor settings.

    ``hub_experts``: MoE expert tensors in the hub's layout, which vLLM reads (transformers 5 then
    cannot load the language model back: the server never does; a reference test passes False)."""
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = _tokenizer()
    ids = {t: vocab[t] for t in SPECIAL}

    torch.manual_seed(SEED)
    text: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": len(vocab),
        "max_position_embeddings": 4096,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True,
        },
    }
    if kind.endswith("_moe"):
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                    norm_topk_prob=True)
    if kind.startswith("qwen3_5"):
        # Qwen3.5's text model mixes linear (gated delta-net) and full attention layers.
        text.update(layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4)
        text["rope_parameters"]["partial_rotary_factor"] = 1.0
        if kind.endswith("_moe"):
            text.update(shared_expert_intermediate_size=32)
    vision: dict[str, Any] = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": OUT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "hidden_act": "gelu_pytorch_tanh",
    }
    if kind.startswith("qwen3_vl"):
        vision["deepstack_visual_indexes"] = DEEPSTACK
    names = {
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
        "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    }[kind]
    config = getattr(transformers, names[0])(
        vision_config=vision,
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = getattr(transformers, names[1])(config).eval()
    # Larger-than-default weights so that greedy tokens depend visibly on the image embedding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if kind.endswith("_moe") and hub_experts:
        _experts_to_hub_layout(path)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=16, merge_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    # Written as JSON, not through Qwen3VLVideoProcessor: transformers' video processors need
    # torchvision, which the server's environment lacks (this builder runs in both).
    nested = {
        "image_processor": {**image_processor.to_dict(), "image_processor_type": "Qwen2VLImageProcessor"},
        "video_processor": {**VIDEO_PROCESSOR, **(video or {})},
        "processor_class": "Qwen3VLProcessor",
    }
    nested["image_processor"].pop("_processor_class", None)
    (path / "processor_config.json").write_text(json.dumps(nested, indent=2, sort_keys=True))
    tokenizer.save_pretrained(path)
    if layout == "hub":
        _to_hub_layout(path)
    return path


def _to_hub_layout(path: Path) -> None:
    """Split ``processor_config.json``'s nested configs into the hub's two files."""
    nested = json.loads((path / "processor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(nested.pop("image_processor"), indent=2))
    (path / "video_preprocessor_config.json").write_text(json.dumps(nested.pop("video_processor"), indent=2))
    (path / "processor_config.json").write_text(json.dumps(nested, indent=2))


def _experts_to_hub_layout(path: Path) -> None:
    """transformers 5 saves fused MoE experts as ``[E, out, in]``; hub checkpoints (and vLLM's loader,
    ``is_fused_checkpoint_transposed``) have ``[E, in, out]``."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for key in tensors:
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
