"""Inputs to what travels: the exact bytes of each file (never re-encoded, so the hash equals
``b3sum FILE``), whether the server reads them as an image or a video, and the ``mm_hash``. A PIL
image has no file bytes; it is saved as PNG (lossless).

A video is one item with one ``mm_hash``, like an image. An input is a video when it is wrapped
in ``Video``, when its path ends in a video suffix (``VIDEO_SUFFIXES``), or when its bytes start
like a video container (``video_type``: mp4/mov, webm/mkv, avi); anything else is an image. A GIF
stays an image unless wrapped: for the Qwen families vLLM reads a GIF as an image.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from blake3 import blake3

__all__ = [
    "AUDIO", "AUDIO_SUFFIXES", "IMAGE", "VIDEO", "VIDEO_SUFFIXES", "ImageInput", "Media", "Video", "WireItem",
    "image_bytes", "media", "mm_hash", "video_type",
]

IMAGE = "image"
VIDEO = "video"
AUDIO = "audio"

# Suffix -> the Content-Type an upload of it carries (the server reads any video/* part as a video).
_SUFFIX_TYPES = {
    ".mp4": "video/mp4", ".m4v": "video/mp4", ".mov": "video/quicktime", ".webm": "video/webm",
    ".mkv": "video/x-matroska", ".avi": "video/x-msvideo",
}
VIDEO_SUFFIXES = frozenset(_SUFFIX_TYPES)
# Suffix -> the Content-Type of an audio file (the server reads any audio/* part as an audio item).
_AUDIO_TYPES = {
    ".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg", ".ogg": "audio/ogg", ".opus": "audio/ogg",
    ".m4a": "audio/mp4", ".aac": "audio/aac", ".webm": "audio/webm",
}
AUDIO_SUFFIXES = frozenset(_AUDIO_TYPES) - VIDEO_SUFFIXES  # a .webm is a video unless said otherwise
_UNKNOWN_VIDEO = "video/octet-stream"  # a wrapped video of no known container: still a video/* upload
_UPLOAD_IMAGE = "application/octet-stream"  # the server sniffs the image format itself
# ISO-BMFF brands of still images (AVIF, HEIF): an ``ftyp`` box alone does not make a video.
_IMAGE_BRANDS = frozenset({b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"})


@dataclass(frozen=True)
class Video:
    """Send ``source`` (a video file's bytes or a path to one) as a video item, whatever its name
    or first bytes say. Needed only where detection cannot tell (an unusual container or name)."""

    source: bytes | bytearray | memoryview | str | os.PathLike[str]


ImageInput = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", Video, Any]
"""Bytes of an image or video file, a path to one, a PIL image, or a ``Video``."""


class Media(NamedTuple):
    """One input as it will travel: the file's bytes, how the server reads them, and the
    ``Content-Type`` of its upload."""

    data: bytes
    modality: str
    content_type: str


class WireItem(NamedTuple):
    """One item of a call: its hash, its bytes (None: asked by hash only), how they read, and the
    processor settings (``mm_processor_kwargs``) it is preprocessed under (None: the server's)."""

    hash: str | None
    data: bytes | None
    modality: str = IMAGE
    content_type: str = _UPLOAD_IMAGE
    settings: Mapping[str, Any] | None = None


def mm_hash(data: bytes) -> str:
    """Lowercase hex BLAKE3-256 of the file's bytes (what ``b3sum`` prints), image or video."""
    return blake3(data).hexdigest()


def video_type(data: bytes) -> str | None:
    """The video ``Content-Type`` that ``data``'s first bytes say, or None (not a known video)."""
    head = bytes(data[:64])
    if head[4:8] == b"ftyp" and head[8:12] not in _IMAGE_BRANDS:  # ISO-BMFF: mp4, mov, 3gp
        return "video/quicktime" if head[8:12] == b"qt  " else "video/mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: its DocType says webm or matroska
        return "video/webm" if b"webm" in head else "video/x-matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":  # (RIFF....WEBP is an image)
        return "video/x-msvideo"
    return None


def image_bytes(image: ImageInput) -> bytes:
    """The file bytes of any input (``Video`` unwrapped)."""
    if isinstance(image, Video):
        image = image.source
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image, without importing PIL
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()
    raise TypeError(f"an item is bytes, a path, a PIL image or a Video, not {type(image).__name__}")


def _suffix(item: ImageInput) -> str:
    return os.path.splitext(os.fspath(item))[1].lower() if isinstance(item, (str, os.PathLike)) else ""


def media(item: ImageInput, modality: str | None = None) -> Media:
    """An input's bytes, modality and upload ``Content-Type`` (see the module doc for the rule);
    ``modality`` given (``"image"``, ``"video"`` or ``"audio"``) says it instead of the rule: the EPD
    proxy's ``image_url`` part is an image whatever its bytes look like. An audio file is one by its
    name's suffix (``.wav``, ``.flac``, ``.mp3``...) or by ``modality="audio"``."""
    if modality not in (None, IMAGE, VIDEO, AUDIO):
        raise ValueError(f"modality must be {IMAGE!r}, {VIDEO!r} or {AUDIO!r}, not {modality!r}")
    if not isinstance(item, Video) and (modality == AUDIO or (modality is None and _suffix(item) in AUDIO_SUFFIXES)):
        return Media(image_bytes(item), AUDIO, _AUDIO_TYPES.get(_suffix(item), "audio/octet-stream"))
    if modality == IMAGE and not isinstance(item, Video):
        return Media(image_bytes(item), IMAGE, _UPLOAD_IMAGE)
    if modality == VIDEO and not isinstance(item, Video):
        item = Video(item)
    data = image_bytes(item)
    sniffed = video_type(data)
    source = item.source if isinstance(item, Video) else item
    suffix = os.path.splitext(os.fspath(source))[1].lower() if isinstance(source, (str, os.PathLike)) else ""
    by_name = _SUFFIX_TYPES.get(suffix)
    if isinstance(item, Video) or sniffed or by_name:
        return Media(data, VIDEO, sniffed or by_name or _UNKNOWN_VIDEO)
    return Media(data, IMAGE, _UPLOAD_IMAGE)
