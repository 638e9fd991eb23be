"""Domain value objects shared by the cache tiers, the batcher, the service and the front doors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Embedding", "EncodedTensor", "ItemResult", "RequestItem"]


@dataclass(frozen=True)
class EncodedTensor:
    """An embedding as it travels and is cached: raw little-endian bytes, dtype and shape."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Embedding:
    """A cached embedding with the per-image meta the client needs (e.g. ``image_grid_thw``)."""

    tensor: EncodedTensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


@dataclass(frozen=True)
class RequestItem:
    """One item of a request: image bytes, a hash, or both (then they must agree)."""

    index: int
    mm_hash: str | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class ItemResult:
    """How one item was resolved. ``embedding`` is None for a miss."""

    index: int
    mm_hash: str
    status: str  # "hit" | "encoded" | "miss"
    source: str | None  # "local" | "redis" | "encoder" | None
    embedding: Embedding | None
    key: str | None = None
