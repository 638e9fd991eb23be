"""Llama 4 images: tiles on a canvas plus a global tile, an unfold-patch ViT with 2D RoPE, pixel
shuffle, and a linear projector.

The image processor (``Llama4ImageProcessor``) picks the canvas of at most ``max_patches`` tiles
of ``size`` px (336 for the hub's checkpoints) that needs the least resizing (``best_fit``: the
smallest upscale, never above one tile's side unless ``resize_to_max_canvas``; else the least
downscale; ties to the smallest area), resizes the image into it without distortion (bilinear,
antialiased), pads it right and bottom with zeros, and cuts it into the ``rows x cols`` tiles,
row by row; when there is more than one, the whole image squashed to one tile comes last. Each
tile goes through the vision model on its own (``Llama4VisionModel``: its patches and a CLS token,
CLS dropped after the last layer, 2 x 2 neighbours pixel-shuffled into one row and through the
adapter MLP), then the projector: ``(size / patch)**2 * pixel_shuffle_ratio**2`` rows a tile (144
for the hub's checkpoints). An image's embedding is its tiles' rows in tile order, global tile
last: what vLLM 0.32's ``mllama4.py`` returns from ``embed_multimodal`` (its ``<|patch|>``
placeholders, in the same order), with ``{"aspect_ratios": [rows, cols], "patches_per_image":
tiles}`` (vLLM's field names) as meta.

The image processor is torchvision-only and the server does not ship torchvision, so its steps are
done here with torch, as transformers' ``TorchvisionBackend`` does them on a uint8 CPU tensor:
``interpolate(uint8, mode="bilinear", antialias=True)`` (torch's native uint8 kernel, which
torchvision uses on AVX2/AVX512 and ARM CPUs; elsewhere float32 then rounded, as it does), zero
padding, then Llama 4's own rescale and normalisation **in bfloat16** (its processor overrides the
fused float32 one: ``to(bfloat16) * rescale_factor``, then ``(x - mean) / std`` in bfloat16). So
the pixels are bfloat16 values, as vLLM's are; they are cast to the compute dtype for the tower.

No per-request settings: vLLM 0.32 counts an image's tiles from the checkpoint's ``max_patches``
(``get_max_num_tiles`` reads the processor built without the request's kwargs), so a request's
``max_patches`` would size the pixels and the placeholder differently; any setting is refused.
"""

from __future__ import annotations

import json
import math
import platform
from collections import defaultdict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from transformers import Llama4Config
from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights

__all__ = ["FAMILY", "Llama4Encoder", "Llama4Tiling", "Llama4Vision", "best_fit", "load_llama4", "load_tiling"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# The hub's checkpoints (and transformers 5's save_pretrained): ``vision_model.*`` and
# ``multi_modal_projector.*`` at the top; nested under ``model.`` when re-saved from another tree.
LAYOUTS: list[Layout] = [
    {"model.vision_model.": "vision_model.", "model.multi_modal_projector.": "multi_modal_projector."},
    {"vision_model.": "vision_model.", "multi_modal_projector.": "multi_modal_projector."},
]

# Llama4ImageProcessor's class defaults (transformers 5.19 and 5.25), under what a checkpoint saves.
_DEFAULTS: dict[str, Any] = {
    "size": {"height": 336, "width": 336}, "max_patches": 16, "resize_to_max_canvas": False, "resample": 2,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


class Llama4Tiling:
    """``Llama4ImageProcessor``'s settings, read from the checkpoint as JSON (the class itself needs
    torchvision): what ``preprocess`` and ``count_tokens`` follow, and what the fingerprint hashes."""

    def __init__(self, raw: dict[str, Any]) -> None:
        merged = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        size = merged["size"]
        self.tile = int(size["height"])
        if int(size["width"]) != self.tile:
            raise ValueError(f"Llama 4 tiles are square, the image processor's size is {size}")
        if merged["resample"] not in (2, "bilinear"):  # PIL's BILINEAR: the processor's class default
            raise ValueError(f"only bilinear resizing is implemented, the image processor names {merged['resample']}")
        if not (merged["do_rescale"] and merged["do_normalize"]) or merged.get("do_resize") is False:
            raise ValueError("only the default resize, rescale and normalisation are implemented")
        self.max_patches = int(merged["max_patches"])
        self.resize_to_max_canvas = bool(merged["resize_to_max_canvas"])
        self.rescale_factor = float(merged["rescale_factor"])
        self.mean = [float(x) for x in merged["image_mean"]]
        self.std = [float(x) for x in merged["image_std"]]

    def __call__(self, images: Image.Image | Sequence[Image.Image], return_tensors: str = "pt") -> dict[str, Any]:
        """What ``Llama4ImageProcessor`` returns for ``images``: every image's tiles, then the
        canvases' (rows, cols)."""
        made = [tile_image(image, self) for image in ([images] if isinstance(images, Image.Image) else images)]
        return {"pixel_values": torch.cat([tiles for tiles, _ in made]),
                "aspect_ratios": torch.tensor([grid for _, grid in made])}

    def to_json_string(self) -> str:
        return json.dumps({"size": {"height": self.tile, "width": self.tile}, "max_patches": self.max_patches,
                           "resize_to_max_canvas": self.resize_to_max_canvas, "resample": "bilinear",
                           "rescale_factor": self.rescale_factor, "image_mean": self.mean, "image_std": self.std,
                           "normalize_dtype": "bfloat16"}, sort_keys=True)


def load_tiling(directory: Path) -> Llama4Tiling:
    """The image processor's settings: ``preprocessor_config.json`` (the hub's, and what
    transformers 5.25 writes), else ``processor_config.json``'s ``image_processor`` (5.19 writes only that)."""
    separate = directory / "preprocessor_config.json"
    if separate.is_file():
        return Llama4Tiling(json.loads(separate.read_text()))
    nested = directory / "processor_config.json"
    if nested.is_file() and isinstance(raw := json.loads(nested.read_text()).get("image_processor"), dict):
        return Llama4Tiling(raw)
    raise FileNotFoundError(f"{directory} has no Llama 4 image processor config")


@lru_cache(maxsize=8)
def _resolutions(max_patches: int, tile: int) -> torch.Tensor:
    """``find_supported_resolutions``: every (rows, cols) canvas of at most ``max_patches`` tiles, in
    pixels, in the processor's order (which decides its ties)."""
    by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for chunks in range(max_patches, 0, -1):
        factors = sorted({f for i in range(1, math.isqrt(chunks) + 1) if chunks % i == 0 for f in (i, chunks // i)})
        for rows in factors:
            by_ratio[rows / (chunks // rows)].append((rows, chunks // rows))
    return torch.tensor([(r * tile, c * tile) for canvases in by_ratio.values() for r, c in canvases])


def _canvas(height: int, width: int, max_patches: int, tile: int, resize_to_max_canvas: bool) -> torch.Tensor:
    """``get_best_fit``: the canvas [height, width] in pixels (an int64 tensor, as the processor
    keeps it: the float32 arithmetic of ``_fitted_size`` follows from that), with its float32
    scales and its ties."""
    resolutions = _resolutions(max_patches, tile)
    scale_h, scale_w = resolutions[:, 0] / height, resolutions[:, 1] / width
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up) > 0:
        chosen = torch.max(up) if resize_to_max_canvas else torch.min(up)
    else:
        chosen = torch.max(scales[scales < 1])
    canvases = resolutions[scales == chosen]
    return canvases[torch.argmin(canvases[:, 0] * canvases[:, 1])] if len(canvases) > 1 else canvases[0]


def best_fit(height: int, width: int, max_patches: int, tile: int, resize_to_max_canvas: bool) -> tuple[int, int]:
    """The canvas (height, width) in pixels an image of this size is tiled on."""
    canvas = _canvas(height, width, max_patches, tile, resize_to_max_canvas)
    return int(canvas[0]), int(canvas[1])


def _fitted_size(height: int, width: int, canvas: torch.Tensor, tile: int, to_max: bool) -> tuple[int, int]:
    """The size the image is resized to inside its canvas: never upscaled beyond one tile's side
    (unless ``to_max``), aspect ratio kept, at least 1 px. Written as ``_preprocess`` and
    ``get_max_res_without_distortion`` compute it, Python's ``min`` between an int and a 0-d tensor
    included: a scale is float32 when its side is the canvas's, float64 otherwise, and the floor of
    the other side follows (200 x 300 into 168 x 280: 251 px wide, not 252)."""
    target_h: Any = canvas[0]
    target_w: Any = canvas[1]
    if not to_max:
        target_h, target_w = min(max(height, tile), target_h), min(max(width, tile), target_w)
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(height * scale_w), target_h), target_w
    else:
        new_h, new_w = target_h, min(math.floor(width * scale_h), target_w)
    return max(int(new_h), 1), max(int(new_w), 1)


_NATIVE_UINT8 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
    "aarch64", "arm64")


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's ``resize`` of a 1 x C x H x W uint8 CPU tensor, bilinear and antialiased."""
    if tuple(image.shape[-2:]) == size:
        return image
    if _NATIVE_UINT8:
        return torch.nn.functional.interpolate(image, size=size, mode="bilinear", align_corners=False, antialias=True)
    resized = torch.nn.functional.interpolate(image.float(), size=size, mode="bilinear", align_corners=False,
                                              antialias=True)
    return resized.round_().to(torch.uint8)


def _normalise(image: torch.Tensor, tiling: Llama4Tiling) -> torch.Tensor:
    """Llama 4's ``rescale_and_normalize``: in bfloat16, as its processor does it."""
    pixels = image.to(torch.bfloat16) * tiling.rescale_factor
    mean = torch.as_tensor(tiling.mean, dtype=torch.bfloat16).view(-1, 1, 1)
    std = torch.as_tensor(tiling.std, dtype=torch.bfloat16).view(-1, 1, 1)
    return pixels.sub(mean).div_(std)


def tile_image(image: Image.Image, tiling: Llama4Tiling) -> tuple[torch.Tensor, tuple[int, int]]:
    """An RGB image to its tiles (T x 3 x tile x tile, bfloat16; the global tile last when T > 1)
    and the canvas's (rows, cols)."""
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).unsqueeze(0)  # channels-last, as torchvision's
    height, width = image.height, image.width
    tile, to_max = tiling.tile, tiling.resize_to_max_canvas
    canvas = _canvas(height, width, tiling.max_patches, tile, to_max)
    fitted = _resize(pixels, _fitted_size(height, width, canvas, tile, to_max))
    canvas_h, canvas_w = int(canvas[0]), int(canvas[1])
    padded = torch.nn.functional.pad(fitted, (0, canvas_w - fitted.shape[-1], 0, canvas_h - fitted.shape[-2]))
    rows, cols = canvas_h // tile, canvas_w // tile
    normalised = _normalise(padded, tiling)
    tiles = normalised.reshape(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
    if rows * cols > 1:
        whole = _normalise(_resize(pixels, (tile, tile)), tiling)
        tiles = torch.cat([tiles, whole])
    return tiles.contiguous(), (rows, cols)


class Llama4Vision(torch.nn.Module):
    """``Llama4ForConditionalGeneration`` without its language model (its attribute names, so its keys)."""

    def __init__(self, config: Llama4Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, adapter, projector); the text model is never built
        self.vision_model = Llama4VisionModel._from_config(config.vision_config, dtype=dtype)
        self.multi_modal_projector = Llama4MultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles (T x 3 x H x W) -> T x rows-a-tile x D: ``get_image_features``' projected rows."""
        return self.multi_modal_projector(self.vision_model(pixel_values).last_hidden_state)


class Llama4Encoder(HFEncoder):
    """Variable N: ``tiles * rows_per_tile`` rows; ``cost_tokens`` counts every tile's patches and CLS."""

    module: Llama4Vision
    processor: Llama4Tiling

    def __init__(self, module: Llama4Vision, processor: Llama4Tiling, spec: LoadSpec, digest: str) -> None:
        super().__init__(module, processor, spec, kind="llama4", output="projected",
                         hidden_size=module.multi_modal_projector.linear_1.out_features, weights_digest=digest)
        vision: Any = module.config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        self.rows_per_tile = patches // round(1.0 / float(vision.pixel_shuffle_ratio) ** 2)
        self.tokens_per_tile = patches + 1

    def use_batched(self, pipeline: Any) -> None:
        raise ValueError("Llama 4's image processor is made here on the CPU; it has no batched device path")

    def _meta(self, rows: int, cols: int) -> tuple[int, dict[str, Any]]:
        tiles = 1 if rows * cols == 1 else rows * cols + 1
        return tiles * self.rows_per_tile, {"aspect_ratios": [rows, cols], "patches_per_image": tiles}

    def preprocess(self, image: Image.Image) -> PreparedItem:
        tiles, (rows, cols) = tile_image(image, self.processor)
        num_tokens, meta = self._meta(rows, cols)
        return PreparedItem({"pixel_values": tiles}, num_tokens, self.cost_of(num_tokens, meta), meta)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """vLLM's count from the size alone (``Mllama4MultiModalProcessor``: the best-fit canvas's tiles)."""
        p = self.processor
        canvas_h, canvas_w = best_fit(height, width, p.max_patches, p.tile, p.resize_to_max_canvas)
        return self._meta(canvas_h // p.tile, canvas_w // p.tile)

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return int(meta["patches_per_image"]) * self.tokens_per_tile

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        with torch.inference_mode():
            rows = self._to_host(self.module(inputs["pixel_values"]))
        tiles = [int(item.meta["patches_per_image"]) for item in batch]
        return [to_encoded(item.flatten(0, 1)) for item in torch.split(rows, tiles)]


def _check_processor(config: Llama4Config, tiling: Llama4Tiling) -> None:
    """Refuse a processor whose tiles are not the tower's size: vLLM sizes its tiles from the tower's
    ``image_size`` and the processor cuts them at its own ``size``."""
    vision: Any = cast(Any, config).vision_config
    if tiling.tile != int(vision.image_size):
        raise ValueError(f"image processor tiles of {tiling.tile} px do not match the tower's {vision.image_size}")


def load_llama4(files: CheckpointFiles, config: Llama4Config, processor: Llama4Tiling, spec: LoadSpec) -> Llama4Encoder:
    """The Llama 4 adapter: the vision model and projector from the checkpoint, the (MoE) language
    model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Llama 4 model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    _check_processor(config, processor)
    module = empty_module(lambda: Llama4Vision(config, spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Llama4Encoder(module, processor, spec, digest)


# vLLM 0.32's mllama4.py parser declares no embedding fields (and its processor asserts pixels):
# the prefill request carries the image (its processor tiles it to size the placeholder) and the uuid.
FAMILY = Family(
    name="llama4",
    model_types=("llama4",),
    load=load_llama4,
    epd=Epd("pixels_uuid", vllm_model="mllama4.py"),
    processor=load_tiling,
)
