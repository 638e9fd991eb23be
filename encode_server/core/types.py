"""Domain value objects shared by the cache tiers, the batcher, the service and the front doors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from encode_server.core.hashing import CacheKey

__all__ = [
    "AUDIO", "ENCODER", "IMAGE", "MODALITIES", "VIDEO", "AudioInfo", "Embedding", "EncodedTensor", "ItemResult",
    "RequestItem", "Resolved", "Return", "VideoInfo",
]

IMAGE = "image"
VIDEO = "video"
AUDIO = "audio"
MODALITIES = (IMAGE, VIDEO, AUDIO)

ENCODER = "encoder"
"""The ``source`` of an embedding this server computed (the other sources are tier names)."""


class Return(str, Enum):
    """What an encode answers with: the same word in the HTTP body's ``"return"``, gRPC's
    ``return_kind`` and the code. ``metadata`` is the EPD hand-off: every resolved item is made
    sure to be in the shared tier and answered with its ``key`` instead of its bytes."""

    EMBEDDINGS = "embeddings"
    METADATA = "metadata"


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
    """A cached embedding with the per-item meta the client needs (the family's grid, ...)."""

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
    """One item of a request: file bytes, a hash, or both (then they must agree). ``modality``
    says how the bytes are read: one image, or one video (one item, one ``mm_hash``, as in vLLM).
    ``settings``: the per-request processor settings (``mm_processor_kwargs``) as the request gave
    them for this item (its own over the request's), unchecked: the service resolves them."""

    index: int
    mm_hash: str | None = None
    data: bytes | None = None
    modality: str = IMAGE
    settings: dict[str, Any] | None = None


@dataclass(frozen=True)
class VideoInfo:
    """What a video's container header says, read without decoding a frame."""

    width: int
    height: int
    num_frames: int
    fps: float
    codec: str = ""

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True)
class AudioInfo:
    """What an audio file's container header says, read without decoding a sample: the first
    audio stream's rate, channels and codec, and its length in samples at that rate (from the
    stream's or the container's duration: a header can lie, so decoding stops at the limit)."""

    sample_rate: int
    channels: int
    num_samples: int
    codec: str = ""

    @property
    def duration(self) -> float:
        return self.num_samples / self.sample_rate

    @property
    def exact_length(self) -> bool:
        """Whether the header states the length exactly (PCM, FLAC's STREAMINFO), rather than
        estimating it from a bitrate (MP3, AAC, Opus)."""
        return self.codec.startswith("pcm_") or self.codec == "flac"


@dataclass(frozen=True)
class Resolved:
    """An embedding found for an item and where it came from: a tier's name (``local``,
    ``redis``: a hit) or :data:`ENCODER` (encoded for this request, or joined in flight)."""

    source: str
    embedding: Embedding

    @property
    def status(self) -> str:
        return "encoded" if self.source == ENCODER else "hit"


@dataclass(frozen=True)
class ItemResult:
    """How one item was resolved. ``embedding`` is None for a miss."""

    index: int
    mm_hash: str
    status: str  # "hit" | "encoded" | "miss"
    source: str | None  # "local" | "redis" | "encoder" | None
    embedding: Embedding | None
    key: CacheKey | None = None
