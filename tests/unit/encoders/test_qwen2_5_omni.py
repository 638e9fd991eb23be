"""Qwen2.5-Omni's adapter on a tiny checkpoint: the audio rules vLLM's processor call sets (the 30 s
window is padding, not a cut), a batch mixing audio with images and videos as each alone, and the
settings it refuses (``use_audio_in_video``). Rows against vLLM's own towers: tests/vllm/test_qwen2_5_omni.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encode_server.core.errors import BadInput
from encode_server.core.settings import resolve
from encode_server.core.types import AudioInfo, VideoInfo
from encode_server.encoders import load_encoder
from encode_server.encoders.qwen2_5_omni import FAMILY
from tests.unit.encoders.util import noise_image


@pytest.fixture(scope="module")
def encoder(qwen2_5_omni_dir: Path) -> Any:
    return load_encoder(str(qwen2_5_omni_dir), device="cpu", dtype="float32")


def _tone(samples: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


@pytest.mark.parametrize("samples", [400, 16_000, 479_840, 479_999, 480_000, 480_001, 480_159, 560_000, 560_123])
def test_the_count_from_the_length_is_what_the_extractor_hears_across_the_30_s_window(
    encoder: Any, samples: int
) -> None:
    """Within 30 s every frame a sample reaches; past it the unpadded waveform's frames (vLLM's
    ``truncation=False``): 25 rows a second either way, nothing cut at 30 s."""
    prepared = encoder.preprocess_audio(_tone(samples), 16_000)
    assert (prepared.num_tokens, prepared.meta) == encoder.count_audio_tokens(samples, 16_000)
    assert prepared.inputs["input_features"].shape == (128, prepared.meta["audio_feature_lengths"][0])
    plan = encoder.plan_audio(AudioInfo(16_000, 1, samples, "pcm_s16le"))
    assert plan.keep_seconds is None and plan.cost_tokens == prepared.cost_tokens


def test_a_batch_mixing_audio_images_and_a_video_gives_each_its_own_rows(encoder: Any) -> None:
    """Each kind's items go through their own tower in one pass; the results come back in order."""
    audio = [encoder.preprocess_audio(_tone(n, seed=n), 16_000) for n in (16_000, 37_000)]
    image = encoder.preprocess(noise_image(100, 70))
    info = VideoInfo(width=56, height=56, num_frames=4, fps=2.0)
    plan = encoder.plan_video(info, 2.0)
    video = encoder.preprocess_video(np.full((len(plan.indices), 56, 56, 3), 90, dtype=np.uint8), plan)
    batch = [audio[0], image, video, audio[1]]
    together = encoder.forward(batch)
    for item, got in zip(batch, together, strict=True):
        [alone] = encoder.forward([item])
        assert got.shape == alone.shape == (item.num_tokens, encoder.info.hidden_size)
        rows, own = (torch.frombuffer(bytearray(t.data), dtype=torch.float32) for t in (got, alone))
        # the same rows up to the float rounding of a larger pass (each kind's items in one pass)
        assert (rows - own).abs().max() <= 1e-5 * max(1.0, float(own.abs().max()))
    assert plan.meta["second_per_grid_ts"] == 1.0


def test_use_audio_in_video_on_an_item_is_refused_with_what_to_send_instead() -> None:
    with pytest.raises(BadInput, match="use_audio_in_video is the prompt's setting, not an item's: send the video "
                                       "as a video item and its sound as an audio item"):
        resolve(FAMILY.settings, {}, {"use_audio_in_video": True}, {}, "video")
