"""The warm-up: the served family's worst case through the real path, before the server is ready.

vLLM profiles each model with its largest dummy inputs before it takes a request, so that the
memory a large input needs is known (and found missing) at start, not at a user's first large
image. The warm-up does the same with what this server's limits allow (``--warmup worst``, the
default):

- **the worst image**: ``--max-image-pixels`` pixels, at the aspect ratio (of a few) the family
  gives the most rows for (``count_tokens``, no model run), as a JPEG decoded and preprocessed
  as a request's image is (``kinds.image_inputs``); then as many copies as one forward pass
  takes (``--max-batch-size``, within ``--max-batch-tokens``), submitted together so that the
  batcher makes one full pass of them;
- **the longest video**, where the family takes video: ``--max-video-seconds`` (fewer where
  ``--max-video-frames`` or ``--max-video-decoded-frames`` allow less), at the largest frame size
  whose decoded frames fit the request-memory budget (``VideoPlan.nbytes``, the figure admission
  charges) and ``--max-image-pixels``; frames made, preprocessed, split and encoded as a request's;
- **the longest audio**, for a family that takes audio (after the image and video cases where it
  takes those too, as Qwen2.5-Omni does): as much as the family reads of one file (Qwen2-Audio's
  30 s window; ``--max-audio-seconds`` for Qwen2.5-Omni, which reads it all), as many as one
  forward pass takes, from a synthetic waveform at the family's rate through its own
  ``preprocess_audio``.

The peak memory over all of it (``Encoder.peak_memory``) is logged and published in ``GET /v1/model``
(``warmup``). A worst case that fails (out of memory on the device or the host, an input the
processor refuses) is :class:`WarmupFailed`: the server does not become ready, and says why in one
line. ``--warmup quick`` runs one 64x64 JPEG instead (a quick start; the peak is then unknown until
traffic brings it).

Then, where ``--forward-workers 0`` put more than one pass side by side on a CPU, ``choose_passes``
times a typical image (a 640x480 photo-like JPEG: best of three decodes and preprocessings, best of two lone
forward passes) and keeps one pass when the tower is not the work (``threads.auto_passes``).
"""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from PIL import Image

from encode_server.config import Settings
from encode_server.core.batcher import Batcher
from encode_server.core.types import AUDIO, IMAGE, VIDEO, AudioInfo, EncodedTensor, VideoInfo
from encode_server.encoders.base import Encoder, MemoryPeak, PreparedItem, VideoPlan
from encode_server.encoders.threads import FORWARD_SHARE, auto_passes
from encode_server.kinds.image import image_inputs

__all__ = [
    "WARMUP_MODES", "PassChoice", "WarmupCase", "WarmupFailed", "WarmupReport", "choose_passes", "initial_passes",
    "prepare_to_serve", "warm_up", "worst_image_size",
]

WARMUP_MODES = ("worst", "quick")
# Aspect ratios (width : height) tried for the worst image: rows grow with the area for most
# families, but tiling and any-resolution families give more at some shapes than at others.
_ASPECTS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 2), (4, 1), (1, 4))
_JPEG_MAX_SIDE = 65_500
_HEADER_FPS = 30.0  # a camera's rate, for the worst video's header (no frame is decoded)
_MIN_SIDE = 32

T = TypeVar("T")
Submit = Callable[[PreparedItem, int], Awaitable[EncodedTensor]]
Run = Callable[[Callable[[], T]], Awaitable[T]]


class WarmupFailed(RuntimeError):
    """The worst case failed: the message is the one line the server logs before it stops."""


@dataclass(frozen=True)
class WarmupCase:
    """One input the warm-up ran: ``items`` of it in one pass (an image), or its ``parts`` (a video)."""

    modality: str
    width: int
    height: int
    num_tokens: int
    cost_tokens: int
    items: int = 1
    frames: int = 0
    seconds: float = 0.0
    parts: int = 1

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"modality": self.modality, "width": self.width, "height": self.height,
                               "num_tokens": self.num_tokens, "cost_tokens": self.cost_tokens}
        if self.modality == VIDEO:
            out.update(frames=self.frames, seconds=round(self.seconds, 3), parts=self.parts)
        elif self.modality == AUDIO:
            out.update(seconds=round(self.seconds, 3), items=self.items)
        else:
            out["items"] = self.items
        return out

    def __str__(self) -> str:
        if self.modality == VIDEO:
            return (f"a {self.seconds:g} s video of {self.frames} frames at {self.width}x{self.height}, "
                    f"{self.num_tokens} rows in {self.parts} parts")
        if self.modality == AUDIO:
            return f"{self.items} audio item(s) of {self.seconds:g} s, {self.num_tokens} rows each, in one pass"
        return f"{self.items} image(s) of {self.width}x{self.height}, {self.num_tokens} rows each, in one pass"


@dataclass(frozen=True)
class WarmupReport:
    mode: str
    cases: tuple[WarmupCase, ...]
    peak: MemoryPeak
    seconds: float
    graphs: str | None = None  # the CUDA graphs captured first, where any

    def describe(self) -> dict[str, Any]:
        """The JSON form ``GET /v1/model`` publishes (``warmup``)."""
        return {
            "mode": self.mode,
            "seconds": round(self.seconds, 3),
            "cases": [c.describe() for c in self.cases],
            "peak_device_bytes": self.peak.device_bytes,
            "peak_host_bytes": self.peak.host_bytes,
            "peak_host_since_start": self.peak.host_since_start,
            "cuda_graphs": self.graphs,
        }

    def line(self) -> str:
        peaks = []
        if self.peak.device_bytes is not None:
            peaks.append(f"device {self.peak.device_bytes / 2**20:.0f} MiB")
        if self.peak.host_bytes is not None:
            since = " (since start)" if self.peak.host_since_start else ""
            peaks.append(f"host {self.peak.host_bytes / 2**20:.0f} MiB{since}")
        cases = "; ".join([*(str(c) for c in self.cases), *([self.graphs] if self.graphs else [])])
        return f"warm-up ({self.mode}) in {self.seconds:.2f} s: {cases}; peak memory: {', '.join(peaks) or 'unknown'}"


def worst_image_size(encoder: Encoder, max_pixels: int) -> tuple[int, int]:
    """The size within ``max_pixels`` (of a few aspect ratios) the family gives the most rows for;
    the square where they tie."""
    best: tuple[int, tuple[int, int]] | None = None
    for w_ratio, h_ratio in _ASPECTS:
        width = max(_MIN_SIDE, math.isqrt(max_pixels * w_ratio // h_ratio))
        height = max(_MIN_SIDE, max_pixels // width)
        try:
            rows, _ = encoder.count_tokens(width, height)
        except ValueError:  # a shape the processor refuses (an extreme aspect ratio)
            continue
        if best is None or rows > best[0]:
            best = (rows, (width, height))
    if best is None:
        side = max(_MIN_SIDE, math.isqrt(max_pixels))
        return side, side
    return best[1]


def _image_file(width: int, height: int) -> bytes:
    """A mid-grey image of this size, as a JPEG (the path most uploads take), or a PNG above JPEG's
    largest side."""
    buffer = io.BytesIO()
    image = Image.new("RGB", (width, height), (127, 127, 127))
    if max(width, height) <= _JPEG_MAX_SIDE:
        image.save(buffer, format="JPEG", quality=50)
    else:
        image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _video_plan(encoder: Encoder, settings: Settings, budget: int | None) -> tuple[VideoInfo, VideoPlan]:
    """The longest video the limits allow, at the largest frame size admission would take."""
    s = settings
    seconds = min(s.max_video_seconds, s.max_video_frames / s.video_fps, s.max_video_decoded_frames / _HEADER_FPS)
    side = max(_MIN_SIDE, math.isqrt(s.max_image_pixels))
    while True:
        info = VideoInfo(side, side, max(1, int(seconds * _HEADER_FPS)), _HEADER_FPS, "h264")
        plan = encoder.plan_video(info, s.video_fps)
        too_many = len(plan.indices) > s.max_video_frames or max(plan.indices) + 1 > s.max_video_decoded_frames
        if too_many and seconds > 1.0:
            seconds *= 0.9
        elif budget is not None and plan.nbytes > budget and side > _MIN_SIDE:
            side = max(_MIN_SIDE, int(side * 0.9))
        else:
            return info, plan


async def _worst_image(encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any]) -> WarmupCase:
    width, height = worst_image_size(encoder, settings.max_image_pixels)
    data = await run(lambda: _image_file(width, height))
    prepared: PreparedItem = await run(lambda: image_inputs(encoder, data, max_pixels=settings.max_image_pixels))
    cost = max(1, prepared.cost_tokens)
    items = max(1, min(settings.max_batch_size, settings.max_batch_tokens // cost))
    await asyncio.gather(*(submit(prepared, prepared.cost_tokens) for _ in range(items)))
    return WarmupCase("image", width, height, prepared.num_tokens, prepared.cost_tokens, items=items)


def _audio(encoder: Encoder, settings: Settings) -> tuple[Any, int]:
    """The longest waveform the family reads of one file (a tone under noise, at its own rate):
    its window (Qwen2-Audio's 30 s), or ``--max-audio-seconds`` where it reads the whole file."""
    import numpy as np

    rate = 16_000
    plan = encoder.plan_audio(AudioInfo(rate, 1, rate * 3600))
    samples = int((plan.keep_seconds or settings.max_audio_seconds) * plan.sample_rate)
    t = np.arange(samples, dtype=np.float32) / plan.sample_rate
    noise = np.random.default_rng(0).standard_normal(samples).astype(np.float32)
    return 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * noise, plan.sample_rate


async def _longest_audio(encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any], *,
                         full: bool) -> WarmupCase:
    waveform, rate = await run(lambda: _audio(encoder, settings))
    prepared: PreparedItem = await run(lambda: encoder.preprocess_audio(waveform, rate))
    cost = max(1, prepared.cost_tokens)
    items = max(1, min(settings.max_batch_size, settings.max_batch_tokens // cost)) if full else 1
    await asyncio.gather(*(submit(prepared, prepared.cost_tokens) for _ in range(items)))
    return WarmupCase(AUDIO, 0, 0, prepared.num_tokens, prepared.cost_tokens, items=items,
                      seconds=len(waveform) / rate)


async def _longest_video(
    encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any], budget: int | None
) -> WarmupCase:
    import numpy as np

    info, plan = await run(lambda: _video_plan(encoder, settings, budget))

    def prepare() -> PreparedItem:
        frames = np.full((len(plan.indices), info.height, info.width, 3), 127, dtype=np.uint8)
        return encoder.preprocess_video(frames, plan)

    prepared = await run(prepare)
    parts = encoder.split(prepared, settings.max_batch_tokens)
    await asyncio.gather(*(submit(p, p.cost_tokens) for p in parts))
    return WarmupCase(VIDEO, info.width, info.height, prepared.num_tokens, prepared.cost_tokens,
                      frames=len(plan.indices), seconds=info.duration, parts=len(parts))


async def _quick(encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any]) -> WarmupCase:
    data = _image_file(64, 64)
    prepared: PreparedItem = await run(lambda: image_inputs(encoder, data, max_pixels=settings.max_image_pixels))
    await submit(prepared, prepared.cost_tokens)
    return WarmupCase("image", 64, 64, prepared.num_tokens, prepared.cost_tokens)


async def warm_up(
    encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any], *, budget: int | None
) -> WarmupReport:
    """Run the warm-up ``settings.warmup`` names (module docstring) through ``submit`` (the
    batcher's) and ``run`` (the preprocessing threads'). Raises :class:`WarmupFailed`."""
    mode = settings.warmup
    started = time.perf_counter()
    cases: list[WarmupCase] = []
    step = "the 64x64 image" if mode == "quick" else "the worst image"
    family = encoder.family
    graphs = None
    try:
        with encoder.peak_memory() as peak:
            step = "the CUDA graphs' capture"
            graphs = encoder.capture_graphs()
            step = "the 64x64 image" if mode == "quick" else "the worst image"
            if family is not None and IMAGE not in family.modalities:  # an audio family
                step = "the longest audio"
                cases.append(await _longest_audio(encoder, settings, submit, run, full=mode != "quick"))
            elif mode == "quick":
                cases.append(await _quick(encoder, settings, submit, run))
            else:
                cases.append(await _worst_image(encoder, settings, submit, run))
                if family is not None and VIDEO in family.modalities:
                    step = "the longest video"
                    cases.append(await _longest_video(encoder, settings, submit, run, budget))
                if family is not None and AUDIO in family.modalities:  # Qwen2.5-Omni: audio beside images
                    step = "the longest audio"
                    cases.append(await _longest_audio(encoder, settings, submit, run, full=True))
    except (MemoryError, RuntimeError, ValueError) as exc:  # torch's OutOfMemoryError is a RuntimeError
        limits = (f"--max-image-pixels {settings.max_image_pixels}, --max-batch-size {settings.max_batch_size}, "
                  f"--max-batch-tokens {settings.max_batch_tokens}")
        done = f" (after {'; '.join(str(c) for c in cases)})" if cases else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WarmupFailed(
            f"the warm-up's worst case failed at {step}{done}: {type(exc).__name__}: {first}; this server cannot "
            f"hold what its limits admit ({limits}): lower them, or give it more memory"
        ) from None
    return WarmupReport(mode, tuple(cases), peak.result, time.perf_counter() - started, graphs)


@dataclass(frozen=True)
class PassChoice:
    """How many forward passes run side by side, and what decided it."""

    passes: int
    reason: str

    def line(self) -> str:
        return f"forward passes: {self.passes} side by side ({self.reason})"


def initial_passes(settings: Settings, concurrency: int) -> PassChoice:
    """The passes a batcher of ``concurrency`` runs before the warm-up measured anything, and why."""
    why = (f"--forward-workers {settings.forward_workers}" if settings.forward_workers
           else "--forward-workers 0: one pass on this device" if concurrency == 1
           else "--forward-workers 0: one per core torch uses, before the warm-up's measurement")
    return PassChoice(concurrency, why)


async def prepare_to_serve(
    encoder: Encoder, settings: Settings, batcher: Batcher[PreparedItem, EncodedTensor], run: Run[Any], *,
    budget: int | None,
) -> tuple[WarmupReport, PassChoice]:
    """The warm-up through ``batcher`` and ``run`` (the preprocessing threads), with every pass
    ``--forward-workers 0`` allows (its peak covers them); then those passes kept only where the
    tower is the work (:func:`choose_passes`), ``batcher`` set to them. ``budget``: the
    request-memory budget's capacity, which bounds the longest video."""
    report = await warm_up(encoder, settings, batcher.submit, run, budget=budget)
    passes = initial_passes(settings, batcher.concurrency)
    if settings.forward_workers == 0 and batcher.concurrency > 1:
        passes = await choose_passes(encoder, settings, batcher.submit, run, batcher.concurrency)
        batcher.concurrency = passes.passes
    return report, passes


def _typical_image(max_pixels: int) -> tuple[bytes, tuple[int, int]]:
    """A 640x480 JPEG with a photo's texture (a gradient under noise: its decode costs what a photo's
    does, where a flat image's costs almost nothing), smaller where ``--max-image-pixels`` is; and
    its size."""
    scale = min(1.0, math.sqrt(max_pixels / (640 * 480)))
    size = (max(_MIN_SIDE, int(640 * scale)), max(_MIN_SIDE, int(480 * scale)))
    gradient = Image.linear_gradient("L").resize(size)
    noise = Image.effect_noise(size, 40)
    image = Image.merge("RGB", (gradient, noise, Image.blend(gradient, noise, 0.5)))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue(), size


async def choose_passes(encoder: Encoder, settings: Settings, submit: Submit, run: Run[Any],
                        passes: int) -> PassChoice:
    """``--forward-workers 0``'s count once measured (module docstring): ``passes`` or one. The
    timings go through the real path: decoding and preprocessing on the preprocessing threads, the pass through
    the batcher, alone (nothing else is running before the server is ready)."""
    family = encoder.family
    if family is not None and IMAGE not in family.modalities:  # an audio family: its longest item
        waveform, rate = await run(lambda: _audio(encoder, settings))
        name, what = "the longest audio item", f"a {len(waveform) / rate:g} s audio item's"
        made: Callable[[], PreparedItem] = lambda: encoder.preprocess_audio(waveform, rate)  # noqa: E731
    else:
        data, (width, height) = _typical_image(settings.max_image_pixels)
        name, what = "a typical image", f"a {width}x{height} JPEG's"
        made = lambda: image_inputs(encoder, data, max_pixels=settings.max_image_pixels)  # noqa: E731
    try:
        forward_s, prepare_s = await _timings(submit, run, made)
    except Exception as exc:  # a family that refuses the input: not a reason to stop the server
        return PassChoice(passes, f"--forward-workers 0: one per core torch uses ({name} could not be "
                                  f"timed: {type(exc).__name__}: {exc})")
    chosen = auto_passes(passes, forward_s, prepare_s)
    relation = "at least" if chosen > 1 else "under"
    return PassChoice(chosen, f"--forward-workers 0: {what} forward pass took "
                              f"{forward_s * 1000:.1f} ms, {relation} {FORWARD_SHARE:g} x its decode and "
                              f"preprocessing ({prepare_s * 1000:.1f} ms)")


async def _timings(submit: Submit, run: Run[Any], made: Callable[[], PreparedItem]) -> tuple[float, float]:
    """(best of two lone forward passes, best of three ``made()``: decode and preprocessing), in seconds."""

    def prepare() -> tuple[PreparedItem, float]:
        best, prepared = math.inf, None
        for _ in range(3):
            started = time.perf_counter()
            prepared = made()
            best = min(best, time.perf_counter() - started)
        assert prepared is not None
        return prepared, best

    prepared, prepare_s = await run(prepare)
    forward_s = math.inf
    for _ in range(2):
        started = time.perf_counter()
        await submit(prepared, prepared.cost_tokens)
        forward_s = min(forward_s, time.perf_counter() - started)
    return forward_s, prepare_s
