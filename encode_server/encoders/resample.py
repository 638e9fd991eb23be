"""Audio resampled as vLLM 0.32 resamples it before a family's feature extractor.

vLLM's multimodal parser (``MultiModalDataParser``, ``audio_resample_method`` "torchaudio" by
default) resamples every audio item to the feature extractor's rate with torchaudio's
``transforms.Resample`` at its defaults: a windowed-sinc (Hann) low-pass FIR, 6 zero crossings wide,
roll-off 0.99, its kernel built in float64 and kept in float32, applied as one strided
convolution. Done here with the same arithmetic, in torch (the server has no torchaudio), so a 44.1
kHz file gives the rows vLLM's tower gives it; ``tests/vllm/test_audio.py`` holds it to vLLM's own
resampler. The rates are reduced by their gcd first, so 44.1 -> 16 kHz is a 441:160 filter bank.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

__all__ = ["MAX_KERNEL_ELEMENTS", "check_resamplable", "kernel_elements", "resample"]

ZERO_CROSSINGS = 6  # torchaudio's lowpass_filter_width
ROLLOFF = 0.99
# The filter bank is new x (orig + 2 width) taps after the gcd: 76 k for 44.1 -> 16 kHz, 291 k for
# 11.025 kHz, but 7e8 for a header claiming 44,101 Hz (5.6 GB per float64 temporary; vLLM's
# torchaudio builds it too). Rates whose bank passes this are refused before anything is decoded.
MAX_KERNEL_ELEMENTS = 1 << 20


def kernel_elements(orig_rate: int, new_rate: int) -> int:
    """The taps of the filter bank for ``orig_rate`` -> ``new_rate`` (0 when they agree)."""
    if orig_rate == new_rate:
        return 0
    gcd = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // gcd, new_rate // gcd
    return new * (orig + 2 * math.ceil(ZERO_CROSSINGS * orig / (min(orig, new) * ROLLOFF)))


def check_resamplable(orig_rate: int, new_rate: int) -> None:
    """Refuse (``ValueError``) a rate whose filter bank passes ``MAX_KERNEL_ELEMENTS``: an audio
    family's ``plan_audio`` calls it before anything is decoded."""
    if (taps := kernel_elements(orig_rate, new_rate)) > MAX_KERNEL_ELEMENTS:
        raise ValueError(f"{orig_rate} Hz cannot be resampled to {new_rate} Hz within bounded "
                         f"memory (a {taps}-tap filter bank); resample it to a common rate first")


@lru_cache(maxsize=16)
def _kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """The filter bank for ``orig`` -> ``new`` (both gcd-reduced): ``[new, 1, taps]`` float32, and
    the padding each side. Row ``j`` interpolates output sample ``j`` of every period of ``orig``
    input samples."""
    cutoff = min(orig, new) * ROLLOFF  # below both Nyquists: no aliasing, no edge ringing
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    # the output phase j / new in float32, as torchaudio computes it, then in float64 with the taps
    t = (torch.arange(0, -new, -1)[:, None, None] / new + taps) * cutoff
    t = t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.tensor(1.0, dtype=t.dtype), t.sin() / t)
    return (sinc * window * (cutoff / orig)).to(torch.float32), width


def resample(waveform: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """``waveform`` (1-D float32) from ``orig_rate`` to ``new_rate``: ``ceil(len * new / orig)``
    samples, unchanged when the rates agree."""
    if orig_rate == new_rate:
        return waveform
    gcd = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // gcd, new_rate // gcd
    kernel, width = _kernel(orig, new)
    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))[None]
    length = x.shape[-1]
    padded = torch.nn.functional.pad(x, (width, width + orig))
    with torch.inference_mode():
        out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig)
    out = out.transpose(1, 2).reshape(-1)
    return out[: math.ceil(new * length / orig)].numpy()
