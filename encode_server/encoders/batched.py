"""Batched preprocessing on the model's device (``--preprocess-device model``), with torchvision.

On a GPU the forward pass of a tower takes milliseconds, and decoding and resizing with Pillow,
an image at a time on the CPU, becomes the bottleneck. So the work is split differently:

- Per image, in a preprocessing thread (``prepare``): the header is read and checked as the CPU
  path checks it (format, pixel limit, EXIF orientation), which gives the token count the batcher
  budgets with. A JPEG whose frame is RGB or grayscale waits as its encoded bytes. Any other image
  (PNG, WebP, GIF, BMP, TIFF, a CMYK JPEG, MPO, a truncated JPEG, a JPEG using a quantization
  table it never defines) is decoded by Pillow as the CPU path decodes it (``imaging.decode_image``),
  into a uint8 CHW tensor in pinned host memory, and waits as that.
- Per batch, in the forward thread (``run``): the batch's JPEGs are decoded by one
  ``torchvision.io.decode_jpeg`` call on the device (nvJPEG's batched decoder on CUDA) while the
  waiting pixels are copied to the device on a side stream; the EXIF orientation is applied on the
  device; then the family's torchvision-backend image processor (transformers 5) runs once over the
  whole batch on the device: resize, rescale, normalise and, for Qwen, patchify. Its output is
  what the CPU path's per-image tensors concatenate to, and goes straight into the model.

A JPEG the device decoder refuses (nvJPEG takes fewer streams than libjpeg) is decoded by Pillow
instead, alone; one that Pillow refuses too gets that item's ``BadInput``, and the rest of the
batch goes on. torchvision is imported only when such a pipeline is built, so the CPU path never
needs it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from encode_server.core.errors import EncodeServerError
from encode_server.imaging import decode_image, read_header

__all__ = ["BatchedPipeline", "Pending", "orient", "torchvision_processor", "torchvision_twin_name"]

# Frames nvJPEG decodes to RGB; CMYK and YCCK JPEGs (and MPO's extra frames) go through Pillow.
_DEVICE_DECODED_MODES = frozenset({"RGB", "L"})


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A CHW image turned as Pillow's ``ImageOps.exif_transpose`` turns it for an EXIF orientation."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-2, -1)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-2, -1)
    if orientation == 6:
        return image.rot90(-1, (-2, -1))
    if orientation == 7:
        return image.transpose(-2, -1).flip(-2, -1)
    if orientation == 8:
        return image.rot90(1, (-2, -1))
    return image


def _complete(data: bytes) -> bool:
    """A JPEG's last scan ends in an EOI marker (inside scan data 0xFF is always stuffed, so the
    pair is the marker); a truncated upload's does not, and goes to Pillow, which refuses it as
    the CPU path does, whatever the device decoder would make of it."""
    return b"\xff\xd9" in data[data.rfind(b"\xff\xda") :]


_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length field


def _tables_defined(data: bytes) -> bool:
    """Every quantization table the frame's components name is defined before the first scan.

    libjpeg refuses a stream that uses an undefined table; nvJPEG decodes it into grey (seen on an
    H200: a 200 with garbage rows where the CPU path answers 400). Such a stream goes to Pillow,
    which refuses it as the CPU path does. Only the header segments are walked, not the scan.
    """
    defined: set[int] = set()
    used: set[int] = set()
    i, end = 2, len(data)
    while i + 4 <= end:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE_MARKERS:
            i += 2
            continue
        if marker == 0xDA:  # start of scan: every table in use must be defined by now
            return bool(used) and used <= defined
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        segment = data[i + 4 : i + 2 + length]
        if marker == 0xDB:  # DQT: (precision << 4 | id, 64 or 128 bytes) repeated
            j = 0
            while j < len(segment):
                defined.add(segment[j] & 0x0F)
                j += 1 + (128 if segment[j] >> 4 else 64)
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and len(segment) >= 6:  # SOFn
            # precision, height, width, count, then (id, sampling, table) per component
            used.update(segment[t] & 0x0F for t in range(8, min(len(segment), 6 + 3 * segment[5]), 3))
        i += 2 + length
    return False


@dataclass
class Pending:
    """One image as it waits for its batch: encoded bytes (``jpeg``) or decoded pixels."""

    data: bytes  # the upload, for Pillow when the device decoder refuses it
    index: int | None
    max_pixels: int
    jpeg: torch.Tensor | None = None  # uint8, 1-D, on the CPU (a copy of ``data``)
    pixels: torch.Tensor | None = None  # uint8 CHW RGB, pinned on CUDA, already oriented
    orientation: int = 1  # still to apply to ``jpeg`` once decoded

    @property
    def held_bytes(self) -> int:
        held = self.jpeg if self.jpeg is not None else self.pixels
        return 0 if held is None else held.numel()


def torchvision_twin_name(processor: Any) -> str:
    """The class name of a transformers image processor's torchvision-backend twin: transformers 5
    names the PIL backend ``<Name>Pil`` and the torchvision one ``<Name>``, with the same settings."""
    return type(processor).__name__.removesuffix("Pil")


def torchvision_processor(processor: Any) -> Any:
    """The torchvision-backend twin of a transformers image processor (itself if it is one), built
    from the processor's own settings (``torchvision_twin_name``)."""
    if getattr(processor, "backend", None) == "torchvision":
        return processor
    import transformers

    name = torchvision_twin_name(processor)
    cls = getattr(transformers, name, None)
    if cls is None or getattr(cls, "backend", None) is None:
        raise ValueError(f"{type(processor).__name__} has no torchvision-backend twin in transformers")
    settings = {k: v for k, v in processor.to_dict().items() if k not in ("image_processor_type", "processor_class")}
    twin = cls(**settings)
    if twin.backend != "torchvision":
        raise ValueError(f"{name} is not a torchvision-backend image processor (torchvision installed?)")
    return twin


class BatchedPipeline:
    """Decode and preprocess whole batches on ``device`` with ``processor`` (torchvision backend).

    ``prepare`` is thread-safe (it reads only immutable state); ``run`` is called from the forward
    thread alone, as ``forward`` is.
    """

    def __init__(self, processor: Any, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg  # the GPU path's one import of it

        self.processor = torchvision_processor(processor)
        self.device = device
        self._decode_jpeg = decode_jpeg
        self._rgb = ImageReadMode.RGB
        self._cuda = device.type == "cuda"
        self._copies = torch.cuda.Stream(device) if self._cuda else None
        self._check_decoder()

    def _check_decoder(self) -> None:
        """Decode one small JPEG on the device now: a torchvision whose image extension did not
        load would otherwise send every JPEG through the Pillow fallback, silently."""
        buffer = io.BytesIO()
        Image.new("RGB", (16, 8), (200, 30, 90)).save(buffer, format="JPEG")
        try:
            decoded = self._decode_jpeg(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8),
                                        mode=self._rgb, device=self.device)
        except RuntimeError as exc:
            raise RuntimeError(f"torchvision cannot decode JPEGs on {self.device}: {exc}") from exc
        if tuple(decoded.shape) != (3, 8, 16):
            raise RuntimeError(f"torchvision decoded a 16x8 JPEG on {self.device} to {tuple(decoded.shape)}")

    def prepare(self, data: bytes, *, max_pixels: int, index: int | None) -> tuple[Pending, int, int]:
        """(pending, width, height), the size as the model will see it (EXIF orientation applied)."""
        header = read_header(data, max_pixels=max_pixels, index=index)
        if (header.format == "JPEG" and header.mode in _DEVICE_DECODED_MODES and _complete(data)
                and _tables_defined(data)):
            jpeg = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            width, height = header.oriented_size
            return Pending(data, index, max_pixels, jpeg=jpeg, orientation=header.orientation), width, height
        pixels = self._host_pixels(data, max_pixels, index)
        return Pending(data, index, max_pixels, pixels=pixels), pixels.shape[2], pixels.shape[1]

    def _host_pixels(self, data: bytes, max_pixels: int, index: int | None) -> torch.Tensor:
        """Pillow's RGB decode (as the CPU path's), as a contiguous uint8 CHW tensor, pinned on CUDA."""
        image = decode_image(data, max_pixels=max_pixels, index=index)
        host = torch.empty((3, image.height, image.width), dtype=torch.uint8, pin_memory=self._cuda)
        host.numpy()[:] = np.asarray(image).transpose(2, 0, 1)  # Pillow's buffer is read-only: one copy
        return host

    def run(self, batch: Sequence[Pending]) -> tuple[dict[str, torch.Tensor] | None, list[EncodeServerError | None]]:
        """The processor's tensors (on the device) for the items that decoded, in order, and for
        each item its error or None. ``None`` inputs when no item decoded."""
        images: list[torch.Tensor | None] = [None] * len(batch)
        errors: list[EncodeServerError | None] = [None] * len(batch)
        uploads = [i for i, p in enumerate(batch) if p.pixels is not None]
        with torch.cuda.stream(self._copies) if self._copies is not None else contextlib.nullcontext():
            for i in uploads:
                pixels = batch[i].pixels
                assert pixels is not None
                images[i] = pixels.to(self.device, non_blocking=True)
        jpegs = [i for i, p in enumerate(batch) if p.jpeg is not None]
        for i, decoded in zip(jpegs, self._decode([batch[i] for i in jpegs]), strict=True):
            if isinstance(decoded, EncodeServerError):
                errors[i] = decoded
            else:
                images[i] = decoded
        if self._copies is not None and uploads:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._copies)
            for i in uploads:  # made on the side stream, used on this one: the allocator must know
                image = images[i]
                assert image is not None
                image.record_stream(current)
        ready = [image for image in images if image is not None]
        if not ready:
            return None, errors
        out = self.processor(images=ready, return_tensors="pt", device=self.device, input_data_format="channels_first")
        return dict(out), errors

    def _decode(self, items: Sequence[Pending]) -> list[torch.Tensor | EncodeServerError]:
        """Every JPEG decoded on the device and oriented; one the device refuses through Pillow."""
        if not items:
            return []
        try:
            decoded = self._decode_jpeg([p.jpeg for p in items], mode=self._rgb, device=self.device)
            return [orient(image, p.orientation) for image, p in zip(decoded, items, strict=True)]
        except RuntimeError:  # one stream in the batch the device decoder does not take: find it
            pass
        out: list[torch.Tensor | EncodeServerError] = []
        for p in items:
            try:
                out.append(orient(self._decode_jpeg(p.jpeg, mode=self._rgb, device=self.device), p.orientation))
            except RuntimeError:
                try:
                    out.append(self._host_pixels(p.data, p.max_pixels, p.index).to(self.device))
                except EncodeServerError as exc:
                    out.append(exc)
        return out
