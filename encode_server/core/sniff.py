"""What a file's first bytes say it is, an image or a video, without decoding it.

Only for error messages: an item sent as the other modality (a PNG as ``video/mp4``, an mp4 as
``image/png``) is refused as unreadable in the modality it claimed, and the hint says which one
its bytes are. The server never reroutes an item by its bytes: the modality stays the caller's.
"""

from __future__ import annotations

__all__ = ["other_modality_hint", "sniff"]

_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"BM", "BMP"),
)
# ISO-BMFF brands of still images (AVIF, HEIF): an ``ftyp`` box alone does not make a video.
_IMAGE_BRANDS = frozenset({b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"})
_TS_PACKET = 188


def sniff(data: bytes) -> tuple[str, str] | None:
    """``("image", "PNG")``, ``("video", "mp4")``... as the first bytes say; None when they say neither."""
    head = bytes(data[:64])
    for magic, name in _IMAGE_MAGIC:
        if head.startswith(magic):
            return "image", name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "WebP"
    if head[4:8] == b"ftyp":
        return None if head[8:12] in _IMAGE_BRANDS else ("video", "mov" if head[8:12] == b"qt  " else "mp4")
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: its DocType says webm or matroska
        return "video", "webm" if b"webm" in head else "mkv"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "avi"
    if len(data) > _TS_PACKET and data[0] == data[_TS_PACKET] == 0x47:  # MPEG-TS sync bytes
        return "video", "MPEG-TS"
    return None


def other_modality_hint(data: bytes, sent_as: str) -> str:
    """A clause for the refusal of ``data`` sent as ``sent_as`` ("image" or "video") when its
    bytes are the other modality's; "" when they are not (or say nothing)."""
    found = sniff(data)
    if found is None or found[0] == sent_as:
        return ""
    modality, name = found
    article = "an" if modality == "image" else "a"
    return (f"; its bytes are {name} {modality} data: send it as {article} {modality} "
            f"(\"modality\": \"{modality}\", or {article} {modality}/* Content-Type)")
