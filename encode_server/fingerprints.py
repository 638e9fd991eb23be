"""The fingerprint every cache key, stored value and exported file of this server carries: what,
besides an item's bytes, changes its embedding (docs/cache.md)."""

from __future__ import annotations

from typing import Any

from encode_server.config import Settings
from encode_server.core.hashing import fingerprint
from encode_server.core.types import VIDEO
from encode_server.encoders.base import Encoder, EncoderInfo

__all__ = ["model_fingerprint", "serving_fingerprint"]


def model_fingerprint(info: EncoderInfo, video_sampling: dict[str, Any] | None = None) -> str:
    """Everything besides the image that changes the embedding (docs/cache.md).

    Content, not names: the digest of the loaded weights stands for the model id and revision, so
    replicas that mount one checkpoint at different paths (or pull it by hub id) share a cache,
    and a re-uploaded checkpoint under an old name does not. For a model that takes videos, the
    server's frame sampling (``--video-fps``) too: two samplings of one file never share an entry.
    """
    fields: dict[str, Any] = {
        "weights_digest": info.weights_digest,
        "architecture": info.architecture,
        "kind": info.kind,
        "output": info.output,
        "dtype": info.dtype,
        "preprocessing": info.preprocessing,
    }
    if video_sampling is not None:
        fields["video_sampling"] = video_sampling
    return fingerprint(fields)


def serving_fingerprint(encoder: Encoder, settings: Settings) -> str:
    """The fingerprint this server keys, stores and exports under: the model's, and for a model
    that takes videos the server's frame sampling too (the service, the tiers and the exporter all
    ask this one function)."""
    family = encoder.family
    takes_video = family is not None and VIDEO in family.modalities
    return model_fingerprint(encoder.info, {"fps": settings.video_fps} if takes_video else None)
