"""Images: one file, one frame, decoded by Pillow (``imaging.py``) with its EXIF orientation applied,
or, for an encoder that decodes and preprocesses whole batches on its device, held as its bytes
until its batch (``Encoder.defer``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from PIL import Image

from encode_server.admission import MemoryCharge
from encode_server.config import Settings
from encode_server.core.errors import BadInput, InvalidRequest, TooLarge
from encode_server.core.types import IMAGE
from encode_server.encoders.base import Encoder, PreparedItem
from encode_server.imaging import decode_image, open_image, oriented_size

from .base import ItemKind, TokenCount

if TYPE_CHECKING:
    from encode_server.preprocess_procs import PreprocessProcesses

__all__ = ["ImageKind", "image_inputs"]


def image_inputs(
    encoder: Encoder, data: bytes, *, max_pixels: int, index: int | None = None,
    settings: Mapping[str, Any] | None = None, opened: Image.Image | None = None,
) -> PreparedItem:
    """Image bytes to ``encoder``'s inputs: deferred to its batch where the encoder preprocesses
    on its device, otherwise decoded here and preprocessed (under ``settings``, the effective
    per-request settings, None for the defaults). ``opened``: ``open_image(data)`` where the caller
    already read the header. Raises ``BadInput``/``TooLarge`` for bad bytes, ``ValueError`` for an
    image the processor refuses. No memory is charged: the caller's."""
    # An item with its own settings takes the host path: a batched pipeline preprocesses a whole
    # batch under one processor config (the server's), which is not this item's.
    if settings is None and (deferred := encoder.defer(data, max_pixels=max_pixels, index=index)) is not None:
        return deferred
    image = decode_image(data if opened is None else opened, max_pixels=max_pixels, index=index)
    return encoder.preprocess(image) if settings is None else encoder.preprocess_with(image, settings)


class ImageKind(ItemKind):
    """An image: charged with its decoded pixels (size from its header) before it is decoded,
    and, where its batch decodes it, with what it holds until then (``PreparedItem.pending``)."""

    modality = IMAGE
    plural = "images"

    def __init__(self, encoder: Encoder, settings: Settings, memory: MemoryCharge,
                 procs: PreprocessProcesses | None = None) -> None:
        super().__init__(encoder, settings, memory)
        self.procs = procs  # --preprocess-processes: images with the server's settings go there

    def prepare(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> PreparedItem:
        max_pixels = self.settings.max_image_pixels
        procs = self.procs if settings is None else None
        # Opened once, for the charge and the decode; where a worker process decodes, the charge
        # alone reads the header here (and only when there is a budget to charge).
        opened = None if procs is not None else open_image(data, max_pixels=max_pixels, index=index)
        with self.memory.pixels(data if opened is None else opened, index) as charge:
            try:
                if procs is not None:
                    prepared = procs.prepare(data, max_pixels=max_pixels, index=index)
                else:
                    prepared = image_inputs(self.encoder, data, max_pixels=max_pixels, index=index,
                                            settings=settings, opened=opened)
            except ValueError as exc:  # e.g. an aspect ratio the processor refuses
                raise BadInput(f"image cannot be preprocessed: {exc}", type="unsupported_image", index=index) from exc
            if prepared.pending is not None and prepared.held_bytes:
                charge.keep_while_alive(prepared.pending, prepared.held_bytes)
        return prepared

    def close(self) -> None:
        if self.procs is not None:
            self.procs.close()

    def count(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> TokenCount:
        """From the header, with the EXIF orientation applied as ``prepare`` applies it (reading
        EXIF can decode a whole small-but-huge PNG: the caller runs this off the event loop)."""
        width, height = oriented_size(data, max_pixels=self.settings.max_image_pixels, index=index)
        return self._count(index, width, height, settings)

    def count_size(self, index: int, size: Sequence[object], settings: Mapping[str, Any] | None) -> TokenCount:
        """A ``[width, height]`` a request gave, checked as an upload's header is, and its rows."""
        if not (len(size) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
            raise InvalidRequest(f"a size is [width, height] of two positive integers, got {list(size)!r}",
                                 index=index)
        width, height = (cast(int, v) for v in size)
        limit = self.settings.max_image_pixels
        if width * height > limit:
            raise TooLarge(f"{width}x{height} = {width * height} pixels is above the limit of {limit} "
                           "(--max-image-pixels)", type="image_too_large", index=index)
        return self._count(index, width, height, settings)

    def _count(self, index: int, width: int, height: int, settings: Mapping[str, Any] | None) -> TokenCount:
        try:
            if settings is None:
                num_tokens, meta = self.encoder.count_tokens(width, height)
            else:
                num_tokens, meta = self.encoder.count_tokens_with(width, height, settings)
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses, as in prepare
            raise BadInput(f"image cannot be preprocessed: {exc}", type="unsupported_image", index=index) from exc
        return TokenCount(index, width, height, num_tokens, meta)
