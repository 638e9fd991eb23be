"""What encode-server itself answers for an item (``POST /v1/encode``), to hold SGLang's rows against,
and its metrics."""

from __future__ import annotations

import base64
import re
from typing import Any

import httpx
import torch

__all__ = ["encode_rows", "items_total", "placeholder_id", "prompt_for"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode_rows(url: str, data: bytes, modality: str = "image") -> tuple[torch.Tensor, dict[str, Any]]:
    """The item's rows and meta as ``/v1/encode`` answers them (JSON, the embedding's raw bytes)."""
    body = {"items": [{"data": base64.b64encode(data).decode(), "modality": modality}]}
    answer = httpx.post(f"{url}/v1/encode", json=body, timeout=120)
    answer.raise_for_status()
    item = answer.json()["items"][0]
    raw = bytearray(base64.b64decode(item["embedding"]))
    rows = torch.frombuffer(raw, dtype=_DTYPES[item["dtype"]]).reshape(item["shape"])
    return rows, item["meta"]


def items_total(url: str, status: str, source: str) -> float:
    """``encode_server_items_total{status, source}`` from the server's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("encode_server_items_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if labels.get("status") == status and labels.get("source") == source:
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompt_for(tokenizer: Any, hf_config: Any, images: int = 0, videos: int = 0, audios: int = 0) -> str:
    """A chat prompt with one placeholder per item, in the family's own tokens as its config names them
    (Qwen's ``vision_start_token_id`` + ``image_token_id`` / ``video_token_id`` + ``vision_end_token_id``,
    the Omni thinkers' ``audio_*_token_id``, Kimi's ``media_placeholder_token_id``): the prompt SGLang's
    processor expands to the items' rows."""
    config = getattr(hf_config, "thinker_config", hf_config)

    def token(name: str) -> str:
        return str(tokenizer.convert_ids_to_tokens(int(getattr(config, name))))

    if hasattr(config, "media_placeholder_token_id"):
        if videos or audios:
            raise ValueError("this family takes images only")
        parts = [token("media_placeholder_token_id") + " "] * images
    else:
        start, end = token("vision_start_token_id"), token("vision_end_token_id")
        parts = [start + token("image_token_id") + end] * images + [start + token("video_token_id") + end] * videos
        if audios:
            audio = token("audio_start_token_id") + token("audio_token_id") + token("audio_end_token_id")
            parts += [audio] * audios
    return "<|im_start|>user\n" + "".join(parts) + "describe<|im_end|>\n<|im_start|>assistant\n"


def placeholder_id(hf_config: Any, modality: str) -> int:
    """The token id SGLang repeats once per row of an item of ``modality``."""
    config = getattr(hf_config, "thinker_config", hf_config)
    if hasattr(config, "media_placeholder_token_id"):
        return int(config.media_placeholder_token_id)
    return int(getattr(config, f"{modality}_token_id"))
