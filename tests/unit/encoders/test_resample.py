"""The resampler vLLM's parser uses by default (torchaudio's windowed sinc), done in torch: its
output length and what it keeps of a signal; its equality with vLLM's own is in tests/vllm/test_audio.py."""

from __future__ import annotations

import numpy as np
import pytest

from encode_server.encoders.resample import MAX_KERNEL_ELEMENTS, kernel_elements, resample


@pytest.mark.parametrize("orig", [8_000, 11_025, 22_050, 44_100, 48_000, 96_000, 192_000])
def test_a_tone_below_both_nyquists_survives_at_the_torchaudio_length(orig: int) -> None:
    t = np.arange(orig) / orig  # 1 s
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = resample(tone, orig, 16_000)
    assert len(out) == int(np.ceil(len(tone) * 16_000 / orig))
    expected = np.sin(2 * np.pi * 440 * np.arange(len(out)) / 16_000)
    middle = slice(200, len(out) - 200)  # away from the zero-padded edges
    assert np.abs(out[middle] - expected[middle]).max() < 2e-2


def test_the_same_rate_is_the_same_samples() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert resample(x, 16_000, 16_000) is x


def test_common_rates_fit_the_filter_bank_bound_and_an_odd_one_does_not() -> None:
    for rate in (8_000, 11_025, 12_000, 22_050, 24_000, 32_000, 37_800, 44_100, 48_000, 88_200, 96_000, 192_000):
        assert kernel_elements(rate, 16_000) <= MAX_KERNEL_ELEMENTS, rate
    assert kernel_elements(44_101, 16_000) > 500 * MAX_KERNEL_ELEMENTS
