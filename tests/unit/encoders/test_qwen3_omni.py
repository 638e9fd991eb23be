"""Qwen3-Omni's adapter on a tiny checkpoint: the audio rules vLLM's processor call sets (padded to
a whole hop, not to a 30 s window; nothing cut), rows equal to the full thinker's for audio and
images (DeepStack side by side), and a batch mixing audio with images and videos as each alone.
Rows against vLLM's own towers: tests/vllm/test_qwen3_omni.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encode_server.core.types import AudioInfo, VideoInfo
from encode_server.encoders import load_encoder
from encode_server.encoders.qwen3_omni import audio_rows
from tests.tiny import qwen3_omni
from tests.unit.encoders.util import noise_image


@pytest.fixture(scope="module")
def encoder(qwen3_omni_moe_dir: Path) -> Any:
    return load_encoder(str(qwen3_omni_moe_dir), device="cpu", dtype="float32")


def _tone(samples: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


def _rows(encoded: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(encoded.data), dtype=torch.float32).reshape(encoded.shape)


def test_the_row_count_is_13_per_100_frames_then_the_remainders() -> None:
    """transformers' ``_get_feat_extract_output_lengths``, which vLLM sizes the placeholder with."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    for frames in (1, 2, 7, 8, 9, 99, 100, 101, 199, 200, 233, 3000, 3501):
        assert audio_rows(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames))), frames


def test_audio_shorter_than_half_a_window_is_refused_from_its_length(encoder: Any) -> None:
    """One hop (10 ms) is no item: the extractor's centred window cannot be padded around it."""
    with pytest.raises(ValueError, match="too short"):
        encoder.count_audio_tokens(160, 16_000)
    assert encoder.count_audio_tokens(161, 16_000)[1] == {"audio_feature_lengths": [2]}


@pytest.mark.parametrize("samples", [161, 400, 16_000, 16_001, 37_123, 479_999, 480_000, 480_001, 560_123])
def test_the_count_from_the_length_is_every_frame_of_the_file_padded_to_a_whole_hop(
    encoder: Any, samples: int
) -> None:
    """``ceil(samples / hop)`` frames (vLLM's ``audio_feature_lengths`` after its hop padding), on
    both sides of 30 s: nothing cut, no window."""
    prepared = encoder.preprocess_audio(_tone(samples), 16_000)
    frames = -(-samples // 160)
    assert prepared.meta == {"audio_feature_lengths": [frames]}
    assert (prepared.num_tokens, prepared.meta) == encoder.count_audio_tokens(samples, 16_000)
    assert prepared.inputs["input_features"].shape == (128, frames)
    plan = encoder.plan_audio(AudioInfo(16_000, 1, samples, "pcm_s16le"))
    assert plan.keep_seconds is None and plan.cost_tokens == prepared.cost_tokens == prepared.num_tokens


@pytest.mark.parametrize("samples", [16_000, 37_123, 560_000])
def test_audio_rows_are_the_full_thinkers(encoder: Any, qwen3_omni_moe_dir: Path, samples: int) -> None:
    waveform = _tone(samples, seed=samples)
    prepared = encoder.preprocess_audio(waveform, 16_000)
    [encoded] = encoder.forward([prepared])
    expected, meta = qwen3_omni.reference_audio_features(qwen3_omni_moe_dir, waveform)
    assert prepared.meta == meta
    assert float((_rows(encoded) - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))


def test_image_rows_are_the_mergers_then_each_deepstack_levels(encoder: Any, qwen3_omni_moe_dir: Path) -> None:
    image = noise_image(150, 100)
    prepared = encoder.preprocess(image)
    [encoded] = encoder.forward([prepared])
    expected, grid = qwen3_omni.reference_image_features(qwen3_omni_moe_dir, image)
    assert encoder.info.hidden_size == 64 * 2 == encoded.shape[1]  # out_hidden_size x (1 + one level)
    assert encoder.info.widths == {"audio": 64}  # the language model's width
    assert prepared.meta == {"image_grid_thw": grid}
    assert float((_rows(encoded) - expected).abs().max()) <= 1e-5 * max(1.0, float(expected.abs().max()))


def test_a_batch_mixing_audio_images_and_a_video_gives_each_its_own_rows(encoder: Any) -> None:
    """Each kind's items go through their own tower in one pass; the results come back in order."""
    audio = [encoder.preprocess_audio(_tone(n, seed=n), 16_000) for n in (16_000, 37_000, 5_000)]
    image = encoder.preprocess(noise_image(100, 70))
    plan = encoder.plan_video(VideoInfo(width=64, height=64, num_frames=4, fps=2.0), 2.0)
    video = encoder.preprocess_video(np.full((len(plan.indices), 64, 64, 3), 90, dtype=np.uint8), plan)
    batch = [audio[0], image, video, audio[1], audio[2]]
    together = encoder.forward(batch)
    for item, got in zip(batch, together, strict=True):
        [alone] = encoder.forward([item])
        width = encoder.info.widths["audio"] if "input_features" in item.inputs else encoder.info.hidden_size
        assert got.shape == alone.shape == (item.num_tokens, width)
        own = _rows(alone)
        assert (_rows(got) - own).abs().max() <= 1e-5 * max(1.0, float(own.abs().max()))
    assert set(plan.meta) == {"video_grid_thw"}
