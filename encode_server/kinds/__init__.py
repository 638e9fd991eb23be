"""One home per input kind: images, videos and audio (``base.ItemKind``).

The composition root (``app.py``) builds, with :func:`kinds_for`, one kind per modality the
loaded family takes, and hands them to the service, which asks the item's kind to prepare or
count it. A new input kind is one module here and one line in ``KINDS``.
"""

from __future__ import annotations

from encode_server.admission import MemoryCharge
from encode_server.config import Settings
from encode_server.core.types import AUDIO, IMAGE, VIDEO
from encode_server.encoders.base import Encoder
from encode_server.preprocess_procs import PreprocessProcesses

from .audio import AudioKind, plan_audio
from .base import ItemKind, TokenCount
from .image import ImageKind, image_inputs
from .video import VideoKind, plan_video

__all__ = [
    "KINDS", "AudioKind", "ImageKind", "ItemKind", "TokenCount", "VideoKind", "image_inputs", "kinds_for",
    "plan_audio", "plan_video",
]

KINDS: dict[str, type[ItemKind]] = {IMAGE: ImageKind, VIDEO: VideoKind, AUDIO: AudioKind}


def kinds_for(
    encoder: Encoder, settings: Settings, memory: MemoryCharge, procs: PreprocessProcesses | None = None
) -> dict[str, ItemKind]:
    """The kinds ``encoder`` takes (its family's modalities; a model without a family: images),
    in the family's order, each charging ``memory``; images preprocessed in ``procs`` where given."""
    family = encoder.family
    modalities = family.modalities if family is not None else (IMAGE,)
    return {
        modality: ImageKind(encoder, settings, memory, procs) if modality == IMAGE
        else KINDS[modality](encoder, settings, memory)
        for modality in modalities
    }
