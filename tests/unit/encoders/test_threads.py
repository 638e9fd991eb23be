"""How many forward passes run side by side on a CPU: the rule ``--forward-workers 0`` applies
after the warm-up, and the timing that feeds it, through a real service."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import torch

from encode_server.config import Settings
from encode_server.encoders import load_encoder
from encode_server.encoders.threads import FORWARD_SHARE, auto_passes
from encode_server.metrics import Metrics
from tests.services import make_service


@pytest.mark.parametrize(("forward_ms", "prepare_ms", "passes"), [
    (2.4, 4.9, 1),  # a tiny CLIP: its preprocessing is the work
    (12.3, 3.9, 2),  # the built-in tower
    (80.7, 4.7, 2),  # a ViT-B/32-sized CLIP
    (5.0, 5.0, 2),  # the boundary keeps them
])
def test_passes_run_side_by_side_only_where_the_tower_is_the_work(
    forward_ms: float, prepare_ms: float, passes: int
) -> None:
    assert auto_passes(2, forward_ms / 1000, prepare_ms / 1000) == passes
    assert auto_passes(1, forward_ms / 1000, prepare_ms / 1000) == 1


def _started(workers: int, encoder: Any = None) -> tuple[int, str]:
    encoder = encoder or load_encoder("builtin:tiny", device="cpu")
    service = make_service(encoder, Settings(forward_workers=workers, warmup="quick"), Metrics())

    async def run() -> tuple[int, str]:
        await service.start()
        try:
            return service.batcher.concurrency, service.passes.reason
        finally:
            await service.close()

    return asyncio.run(run())


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: one pass, nothing to choose")
def test_the_auto_count_is_what_its_own_timing_says() -> None:
    """The service times a typical image at start and keeps the passes the rule gives for those
    figures (the figures vary with the machine's load; the decision must follow them)."""
    passes, reason = _started(0)
    found = re.search(r"forward pass took ([\d.]+) ms, (at least|under) [\d.]+ x its decode and preprocessing "
                      r"\(([\d.]+) ms\)", reason)
    assert found, reason
    forward_ms, prepare_ms = float(found[1]), float(found[3])
    expected = auto_passes(min(torch.get_num_threads(), 4), forward_ms, prepare_ms)
    assert passes == expected and (found[2] == "at least") == (forward_ms >= FORWARD_SHARE * prepare_ms), reason


def test_a_given_count_is_kept_and_named() -> None:
    assert _started(3) == (3, "--forward-workers 3")


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: one pass, nothing to choose")
def test_an_image_the_timing_cannot_prepare_keeps_the_passes_and_says_why() -> None:
    """The warm-up's image passes; the typical one is refused (as a family might refuse its size):
    the server still starts, with one pass per core and the reason."""
    encoder: Any = load_encoder("builtin:tiny", device="cpu")
    preprocess, calls = encoder.preprocess, []

    def refusing_after_the_warm_up(image: Any) -> Any:
        calls.append(image.size)
        if len(calls) > 1:
            raise ValueError("this size is refused")
        return preprocess(image)

    encoder.preprocess = refusing_after_the_warm_up
    passes, reason = _started(0, encoder)
    assert passes == min(torch.get_num_threads(), 4) and len(calls) == 2
    assert reason.endswith("(a typical image could not be timed: ValueError: this size is refused)"), reason
