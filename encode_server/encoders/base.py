"""The one interface every model family implements.

Split as infinity's batch handler is: ``preprocess`` (any worker thread, per item) is apart from
``forward`` (one thread, a batch of many requests' items) so that the per-item work on the next
items overlaps with the forward pass of the current batch. An item's bytes are decoded by its kind
(``kinds/``: Pillow for an image, FFmpeg for a video or an audio file), which hands the family its
pixels, frames or samples; with batched preprocessing on the model's device
(``encoders/batched.py``) an image is only read to its header (``defer``), and ``forward`` decodes
and preprocesses the whole batch on the device first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from encode_server.core.errors import EncodeServerError
from encode_server.core.types import AudioInfo, EncodedTensor, VideoInfo

from .family import Family
from .memory import MemoryPeak, PeakMemory

__all__ = [
    "AudioPlan",
    "EncodedTensor",
    "Encoder",
    "EncoderInfo",
    "MemoryPeak",
    "PeakMemory",
    "PreparedItem",
    "VideoPlan",
]


@dataclass(frozen=True)
class EncoderInfo:
    """What the encoder is; every field that changes the embedding feeds the fingerprint."""

    model_id: str
    revision: str | None
    # The checkpoint's ``model_type`` as its family names it: one of ``encoders.FAMILIES``' model
    # types, a ``*_vision_model`` checkpoint under its model's ("clip" for "clip_vision_model").
    kind: str
    output: str  # "hidden" | "pooled" | "projected" | "merged"
    dtype: str  # "float32" | "bfloat16" | "float16": the embedding's dtype
    device: str
    hidden_size: int  # D, the embedding's last dimension
    weights_digest: str  # BLAKE3 over the loaded (vision-only) state dict
    preprocessing: dict[str, Any]  # the image processor's config, JSON-able
    num_parameters: int  # resident parameters: the vision tower (+ projector) only
    meaningless: bool = False  # built-in random weights: deterministic, not useful
    # The module's config (depth, feature layer, window size...), machine-specific keys removed:
    # editing config.json next to unchanged weights must change the fingerprint too.
    architecture: dict[str, Any] = field(default_factory=dict)
    # A modality's row width where it is not ``hidden_size`` (Qwen3-Omni: its audio rows are the
    # language model's width, its vision rows DeepStack-packed, wider): what vLLM's encoder cache
    # holds for that modality's items. Follows from the weights: not a fingerprint field.
    widths: dict[str, int] = field(default_factory=dict)


@dataclass
class PreparedItem:
    """One item turned into model inputs, as the batcher queues it: an image, a video, or one part
    of a video (``Encoder.split``); ``cost_tokens`` is what it weighs in a batch."""

    inputs: dict[str, torch.Tensor]
    num_tokens: int  # N, the rows of this image's embedding
    cost_tokens: int  # patch tokens through the vision tower (budgeted by --max-batch-tokens)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able: what the LLM needs beside the rows (a grid)
    # Batched preprocessing: the image as it waits for its batch (encoded bytes, or pixels decoded
    # on the CPU), decoded and preprocessed by ``forward``; ``inputs`` is then empty.
    pending: Any = None
    held_bytes: int = 0  # host memory ``pending`` holds beyond the request's own bytes, until forward


@dataclass(frozen=True)
class VideoPlan:
    """How one video becomes rows, decided from its header alone (``/v1/tokens``, the memory charge).

    ``indices``: the frames to decode, in order; ``size``: (height, width) each is resized to;
    ``num_tokens``/``cost_tokens``/``meta`` as for an image (``meta``: the family's, e.g. the video's grid);
    ``nbytes``: the peak host memory of decoding and preprocessing it, which the request-memory
    budget charges before a frame is decoded (the family knows its copies: no default)."""

    indices: tuple[int, ...]
    size: tuple[int, int]
    num_tokens: int
    cost_tokens: int
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AudioPlan:
    """How one audio file becomes rows, decided from its header alone (the memory charge).

    ``sample_rate``: the rate the family's feature extractor takes (the waveform is resampled to
    it); ``keep_seconds``: how much of the file the family reads (Qwen2-Audio's 30 s window), None
    for all of it; ``cost_tokens`` as for an image; ``nbytes``: the peak host memory of decoding,
    resampling and featurising it, charged before a sample is decoded."""

    sample_rate: int
    keep_seconds: float | None
    cost_tokens: int
    nbytes: int


class Encoder(ABC):
    """A loaded model's encoder: its vision tower (and projector), and its audio tower where the
    family takes audio. ``preprocess`` is thread-safe; ``forward`` is called
    from one thread at a time, under ``torch.inference_mode``."""

    info: EncoderInfo
    family: Family | None = None  # set by ``load_encoder``: what the server publishes about it
    dtype_reason: str = ""  # set by ``load_encoder``: why this dtype (``GET /v1/model``)

    @property
    def preprocesses_on_device(self) -> bool:
        """Whether ``forward`` decodes and preprocesses its batch on the device
        (``encoders/batched.py``): such passes run one at a time (``threads.forward_workers``)."""
        return False

    def use_graphs(self, max_tokens: int) -> bool:
        """Replay the tower's forward from CUDA graphs at token budgets up to ``max_tokens`` patch
        rows, where the device and family allow it (``cuda_graphs.py``); whether it will."""
        return False

    def capture_graphs(self) -> str | None:
        """Record the graphs ``use_graphs`` asked for (the warm-up, inside its memory peak); a
        line for the log, None when there are none."""
        return None

    def peak_memory(self) -> PeakMemory:
        """A context that measures the peak memory of the work inside it on this encoder's device
        (and in host memory): the warm-up's figure (``encoders/memory.py``)."""
        return PeakMemory(self.info.device)

    @abstractmethod
    def preprocess(self, image: Image.Image) -> PreparedItem:
        """An RGB image (EXIF orientation already applied) to inputs, its token count and meta."""

    def host_twin(self) -> Encoder | None:
        """This encoder without its weights, picklable, for ``--preprocess-processes``: its
        ``preprocess`` in a worker process makes what it makes here. None (the default): this
        encoder preprocesses on threads only."""
        return None

    def defer(self, data: bytes, *, max_pixels: int, index: int | None = None) -> PreparedItem | None:
        """For an encoder that decodes and preprocesses whole batches on its device
        (``encoders/batched.py``): the image as it waits for its batch, its header read, its rows
        counted. None (the default): images are decoded on the host (``kinds/image.py``) and
        handed to ``preprocess``."""
        return None

    @abstractmethod
    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        """One forward pass over ``batch``; one embedding per image, in order. An item whose bytes
        turn out bad only when its batch decodes them gets its error instead, alone."""

    @abstractmethod
    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """(N, meta) for an image of this size, without running the model."""

    # -- per-request settings: a family that declares ``Family.settings`` overrides these --------

    def setting_defaults(self) -> dict[str, Any]:
        """The value of each declared setting when a request gives none: the checkpoint's own
        processor config, so that a request restating it keeps the default cache key."""
        return {}

    def preprocess_with(self, image: Image.Image, settings: Mapping[str, Any]) -> PreparedItem:
        """``preprocess`` under the effective ``settings`` (every declared key, checked)."""
        raise NotImplementedError(f"{type(self).__name__} takes no per-request settings")

    def count_tokens_with(self, width: int, height: int, settings: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """``count_tokens`` under the effective ``settings``."""
        raise NotImplementedError(f"{type(self).__name__} takes no per-request settings")

    # -- video: a family that takes videos (``"video" in family.modalities``) overrides these --

    def plan_video(self, info: VideoInfo, fps: float) -> VideoPlan:
        """Which frames of a video (``info``: its header) sampled at ``fps`` are encoded, and what
        they cost, without decoding any."""
        raise NotImplementedError(f"{type(self).__name__} takes no video")

    def preprocess_video(self, frames: Any, plan: VideoPlan) -> PreparedItem:
        """The decoded frames (``[T, H, W, 3]`` uint8, ``plan.indices``) to model inputs."""
        raise NotImplementedError(f"{type(self).__name__} takes no video")

    # -- audio: a family that takes audio (``"audio" in family.modalities``) overrides these ------

    def plan_audio(self, info: AudioInfo) -> AudioPlan:
        """What an audio file (``info``: its header) costs, without decoding a sample."""
        raise NotImplementedError(f"{type(self).__name__} takes no audio")

    def preprocess_audio(self, waveform: Any, sample_rate: int) -> PreparedItem:
        """A mono float32 waveform at ``sample_rate`` (the file's own) to model inputs, its rows and
        meta. Raises ``ValueError`` for audio the model cannot represent (too short)."""
        raise NotImplementedError(f"{type(self).__name__} takes no audio")

    def count_audio_tokens(self, num_samples: int, sample_rate: int) -> tuple[int, dict[str, Any]]:
        """(N, meta) for ``num_samples`` decoded samples at ``sample_rate``, without the model."""
        raise NotImplementedError(f"{type(self).__name__} takes no audio")

    def split(self, prepared: PreparedItem, max_cost: int) -> list[PreparedItem]:
        """``prepared`` cut into parts of at most ``max_cost`` (where the model allows it) whose
        forward passes, concatenated, are its own: a long video does not hold the model for one
        long pass. Default: not cut."""
        return [prepared]
