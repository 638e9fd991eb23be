"""Typed results. Tensors arrive as raw little-endian bytes plus dtype and shape; numpy has no
bfloat16, so ``.numpy()`` widens bf16 to float32 exactly, while ``.torch()`` keeps it bf16."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from encode_client import safetensors
from encode_client.safetensors import DTYPES

if TYPE_CHECKING:
    import torch

__all__ = ["LookupItem", "Result", "TokenCount", "UploadStats", "WarmItem", "to_numpy", "to_torch"]

def to_numpy(raw: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Raw little-endian tensor bytes to numpy; bfloat16 widens exactly to float32."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return safetensors.to_numpy(safetensors.WireTensor("", dtype, tuple(shape), raw))


def to_torch(raw: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """Raw bytes to a torch tensor of the same dtype (bf16 stays bf16). Needs torch installed."""
    try:
        import torch
    except ImportError as exc:  # torch is optional: pip install 'encode-client[torch]'
        raise ImportError("Result.torch() needs torch: pip install 'encode-client[torch]'") from exc
    if not raw:
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(tuple(shape))


@dataclass(frozen=True)
class Result:
    """One item's embedding, an image's or a video's (``status`` "hit" or "encoded"; "miss"
    carries no tensor). ``meta`` is what the family's processor says of the item (its grid, a
video's timestamps: ``GET /v1/model`` names the keys).

    ``model`` and ``fingerprint`` are those of the replica that answered (``GET /v1/model``)."""

    index: int
    hash: str
    status: str
    source: str | None
    num_tokens: int | None
    shape: tuple[int, ...]
    dtype: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    data: bytes = field(default=b"", repr=False)
    replica: str | None = None
    key: str | None = None
    model: str | None = None
    fingerprint: str | None = None

    def _check(self) -> str:
        if self.dtype is None or self.status == "miss":
            raise ValueError(f"item {self.index} ({self.hash}) is a miss: no embedding")
        return self.dtype

    def numpy(self) -> np.ndarray:
        return to_numpy(self.data, self._check(), self.shape)

    def torch(self) -> torch.Tensor:
        return to_torch(self.data, self._check(), self.shape)


@dataclass(frozen=True)
class LookupItem:
    hash: str
    cached: bool
    tier: str | None


@dataclass(frozen=True)
class TokenCount:
    """Tokens an image or video will produce; ``width``/``height``: an image's EXIF-oriented size
    as the server sees it, a video's frames'."""

    index: int
    num_tokens: int
    width: int
    height: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WarmItem:
    """``status`` "hit" (was cached) or "encoded" (uploaded and encoded now)."""

    index: int
    hash: str
    status: str
    replica: str | None = None


@dataclass(frozen=True)
class UploadStats:
    """How the client has sent images so far (``Client.stats``).

    ``mode`` is what the next ``encode`` will do: "hash-first" (ask by hash, upload the misses)
    or "upload" (send the bytes at once, because recent hits were too rare to pay for the extra
    round trip: the adaptive default). ``recent_hit_rate`` is over the last ``window`` images;
    None before any.
    """

    mode: str
    recent_hit_rate: float | None
    hash_first_items: int  # images asked for by hash first
    direct_items: int  # images uploaded without asking first
    hits: int  # images a replica already held (asked by hash, or uploaded and found)
    misses: int  # images a replica had to encode
    uploaded_bytes: int  # image bytes sent
    switches: int  # times the adaptive mode changed its mind
