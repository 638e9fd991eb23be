"""The batched path (decode and preprocess a batch on the model's device) against the CPU path.

Tolerances, in the processor's normalised units (one uint8 level is 1/255/std, about 0.015 for
CLIP's std): on the CPU the batched path runs the very kernels the CPU path runs when torchvision
is installed (libjpeg-turbo, torchvision's resize), so its inputs are bit-identical to the
torchvision processor's on Pillow-decoded images; against the Pillow-backend processor (the CPU
path where torchvision is absent) they differ by at most 1.5 uint8 levels (max abs 0.025), 1e-3 on
average, from the two resize implementations. On CUDA nvJPEG decodes differently from libjpeg and
the GPU's resize kernels round differently. Measured on an H200 (torch 2.11, torchvision 0.26):
decoded pixels 2.1-3.0 uint8 levels apart on average (13-32 at most); the Qwen processor's inputs
max abs 0.22 and 0.011 on average; a float32 tiny Qwen tower's embeddings 2.2% and 5.0% apart
(relative L2, two runs: its random weights amplify input differences). The CUDA limits give that
room: max abs 0.3 and 0.02 on average, 4 levels on average for decoded pixels, embeddings within
10% (a wrong orientation, normalisation or image order is off by far more).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from bench.workload import photos
from encode_server.core.errors import BadInput
from encode_server.core.types import EncodedTensor
from encode_server.encoders import load_encoder
from encode_server.encoders.base import PreparedItem
from encode_server.encoders.hf import HFEncoder
from encode_server.imaging import decode_image
from encode_server.kinds import image_inputs
from tests.gpu.conftest import DEVICES
from tests.images import image_bytes, jpeg_without_tables, truncated_jpeg

MAX_PIXELS = 10**8
FAMILIES = ("qwen2_5_vl", "clip", "siglip", "siglip2", "llava")


def _images() -> list[bytes]:
    """Photo-like JPEGs of two sizes and orientations, a PNG with alpha, a grayscale JPEG."""
    gray = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 120), dtype=np.uint8), "L").save(gray, "JPEG")
    return [*photos(11, 2), *photos(21, 1, 300, 500), image_bytes("PNG", 70, 50), gray.getvalue()]


def _batched(path: Path, device: str, **kwargs: Any) -> HFEncoder:
    encoder = load_encoder(str(path), device=device, preprocess_device="model", **kwargs)
    assert isinstance(encoder, HFEncoder) and encoder.batched is not None
    return encoder


def _decode(encoded: EncodedTensor | Exception) -> torch.Tensor:
    assert isinstance(encoded, EncodedTensor), encoded
    return torch.frombuffer(bytearray(encoded.data), dtype=getattr(torch, encoded.dtype)).reshape(encoded.shape)


def _limits(device: str) -> tuple[float, float]:
    return (0.025, 1e-3) if device == "cpu" else (0.3, 0.02)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_inputs_match_the_cpu_path(family_dirs: dict[str, Path], family: str, device: str) -> None:
    path, images = family_dirs[family], _images()
    encoder = _batched(path, device)
    prepared = [image_inputs(encoder, data, max_pixels=MAX_PIXELS, index=i) for i, data in enumerate(images)]
    assert encoder.batched is not None
    made, errors = encoder.batched.run([p.pending for p in prepared])
    assert errors == [None] * len(images) and made is not None
    pixels = made["pixel_values"].cpu()
    decoded = [decode_image(data, max_pixels=MAX_PIXELS) for data in images]
    pil = AutoImageProcessor.from_pretrained(path, backend="pil")
    reference = torch.cat([pil(images=image, return_tensors="pt")["pixel_values"] for image in decoded])
    worst, mean = _limits(device)
    diff = (pixels - reference).abs()
    assert diff.max().item() <= worst and diff.mean().item() <= mean, (diff.max().item(), diff.mean().item())
    if device == "cpu":  # the same kernels as the torchvision processor on Pillow's decode: identical
        same = encoder.batched.processor(images=decoded, return_tensors="pt")["pixel_values"]
        assert torch.equal(pixels, same)
    cpu_path = load_encoder(str(path), device=device)
    for mine, theirs in zip(prepared, (image_inputs(cpu_path, d, max_pixels=MAX_PIXELS) for d in images), strict=True):
        assert (mine.num_tokens, mine.cost_tokens, mine.meta) == (theirs.num_tokens, theirs.cost_tokens, theirs.meta)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "siglip2", "clip"])
def test_batched_embeddings_match_the_cpu_path(family_dirs: dict[str, Path], family: str, device: str) -> None:
    path, images = family_dirs[family], _images()
    encoder = _batched(path, device, dtype="float32")
    cpu_path = load_encoder(str(path), device=device, dtype="float32")
    ours = encoder.forward([image_inputs(encoder, d, max_pixels=MAX_PIXELS, index=i) for i, d in enumerate(images)])
    theirs = cpu_path.forward([image_inputs(cpu_path, d, max_pixels=MAX_PIXELS) for d in images])
    for a, b in zip(ours, theirs, strict=True):
        x, y = _decode(a), _decode(b)
        assert x.shape == y.shape
        assert ((x - y).norm() / y.norm()).item() <= (0.02 if device == "cpu" else 0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_the_cpu_path_applies_it(device: str, orientation: int) -> None:
    image = Image.open(io.BytesIO(photos(31, 1, 96, 64)[0]))
    exif = image.getexif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes(), quality=95)
    data = buffer.getvalue()
    encoder = load_encoder("builtin:tiny", device=device, preprocess_device="model")
    assert isinstance(encoder, HFEncoder) and encoder.batched is not None
    prepared = image_inputs(encoder, data, max_pixels=MAX_PIXELS)
    [ours] = encoder.batched._decode([prepared.pending])
    assert isinstance(ours, torch.Tensor)
    reference = torch.from_numpy(np.asarray(decode_image(data, max_pixels=MAX_PIXELS)).copy()).permute(2, 0, 1)
    assert ours.shape == reference.shape
    diff = (ours.cpu().int() - reference.int()).abs()
    assert diff.max().item() == 0 if device == "cpu" else diff.float().mean().item() < 4.0


def _refused(encoder: HFEncoder, index: int) -> PreparedItem:
    """An item waiting as a JPEG stream that every decoder refuses (start and end of image, nothing
    between), put in by hand: ``prepare`` itself sends every stream it can tell is bad to Pillow."""
    item = image_inputs(encoder, photos(42, 1)[0], max_pixels=MAX_PIXELS, index=index)
    stream = b"\xff\xd8\xff\xd9"
    item.pending.data, item.pending.jpeg = stream, torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    return item


@pytest.mark.parametrize("device", DEVICES)
def test_a_jpeg_the_batch_decoder_refuses_is_decoded_alone_and_fails_alone(device: str) -> None:
    """A waiting stream the device's batch decode refuses (nvJPEG takes fewer streams than
    libjpeg) is decoded alone, then by Pillow; one Pillow refuses too is that item's error."""
    encoder = load_encoder("builtin:tiny", device=device, preprocess_device="model", dtype="float32")
    good = photos(41, 2)
    batch = [image_inputs(encoder, good[0], max_pixels=MAX_PIXELS, index=0), _refused(encoder, 1),
             image_inputs(encoder, good[1], max_pixels=MAX_PIXELS, index=2)]
    first, bad, last = encoder.forward(batch)
    assert isinstance(bad, BadInput) and bad.type == "invalid_image" and bad.index == 1
    single = load_encoder("builtin:tiny", device=device, preprocess_device="model", dtype="float32")
    [alone] = single.forward([image_inputs(single, good[1], max_pixels=MAX_PIXELS)])
    assert isinstance(first, EncodedTensor) and isinstance(last, EncodedTensor)
    # the last item is its own image's rows, whatever the batch (cuDNN's TF32 convolutions differ by batch)
    tolerance = {} if device == "cpu" else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(_decode(last), _decode(alone), **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_a_jpeg_without_its_quantization_tables_is_refused_when_prepared(device: str) -> None:
    """nvJPEG decodes such a stream into grey (seen on an H200) where libjpeg refuses it: it never
    reaches the device decoder, and Pillow refuses it as on the CPU path."""
    encoder = load_encoder("builtin:tiny", device=device, preprocess_device="model")
    with pytest.raises(BadInput, match="cannot decode") as refused:
        image_inputs(encoder, jpeg_without_tables(), max_pixels=MAX_PIXELS, index=1)
    assert refused.value.type == "invalid_image" and refused.value.index == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_truncated_jpeg_is_refused_when_prepared_as_on_the_cpu_path(device: str) -> None:
    """No end marker after its last scan: Pillow decodes it there and then, and refuses it, so the
    answer does not depend on what the device decoder makes of a short stream."""
    encoder = load_encoder("builtin:tiny", device=device, preprocess_device="model")
    with pytest.raises(BadInput, match="truncated") as refused:
        image_inputs(encoder, truncated_jpeg(), max_pixels=MAX_PIXELS, index=2)
    assert refused.value.type == "invalid_image" and refused.value.index == 2


@pytest.mark.parametrize("device", DEVICES)
def test_formats_the_device_does_not_decode_wait_as_pillow_pixels(device: str) -> None:
    encoder = load_encoder("builtin:tiny", device=device, preprocess_device="model")
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(photos(51, 1)[0])).convert("CMYK").save(cmyk, format="JPEG")
    for data in (image_bytes("PNG", 70, 50), image_bytes("WEBP", 40, 30), cmyk.getvalue()):
        prepared = image_inputs(encoder, data, max_pixels=MAX_PIXELS)
        pending: Any = prepared.pending
        assert pending.jpeg is None and pending.pixels is not None
        assert prepared.held_bytes == pending.pixels.numel()
        reference = np.asarray(decode_image(data, max_pixels=MAX_PIXELS)).transpose(2, 0, 1)
        assert np.array_equal(pending.pixels.numpy(), reference)
    jpeg = image_inputs(encoder, photos(52, 1)[0], max_pixels=MAX_PIXELS)
    assert jpeg.pending.pixels is None and jpeg.held_bytes == len(photos(52, 1)[0])


def test_the_fingerprint_says_the_pipeline_and_the_cpu_path_keeps_its_own(family_dirs: dict[str, Path]) -> None:
    cpu_path = load_encoder(str(family_dirs["qwen2_5_vl"]), device="cpu")
    batched = _batched(family_dirs["qwen2_5_vl"], "cpu")
    assert "pipeline" not in cpu_path.info.preprocessing
    assert batched.info.preprocessing["pipeline"] == "batched:cpu"
    assert batched.info.preprocessing["processor_class"] == "Qwen2VLImageProcessor"


def test_an_empty_batch_and_a_batch_of_only_bad_items() -> None:
    encoder = load_encoder("builtin:tiny", device="cpu", preprocess_device="model")
    assert encoder.forward([]) == []
    assert isinstance(encoder, HFEncoder)
    [error] = encoder.forward([_refused(encoder, 3)])
    assert isinstance(error, BadInput) and error.index == 3


@pytest.mark.parametrize("device", DEVICES)
def test_auto_decodes_on_the_gpu_only_for_a_family_no_vllm_prefill_consumes(family_dirs: dict[str, Path],
                                                                            device: str) -> None:
    """A vLLM prefill consumes Qwen's embeddings: they keep Pillow's decode, which is vLLM's."""
    clip = load_encoder(str(family_dirs["clip"]), device=device, preprocess_device="auto")
    assert isinstance(clip, HFEncoder) and (clip.batched is not None) == (device == "cuda")
    for model in (str(family_dirs["qwen2_5_vl"]), "builtin:tiny"):
        consumed = load_encoder(model, device=device, preprocess_device="auto")
        assert isinstance(consumed, HFEncoder) and consumed.batched is None
