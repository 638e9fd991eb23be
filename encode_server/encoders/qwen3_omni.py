"""The Qwen3-Omni-MoE thinker: images and videos through its Qwen3-VL-style vision tower (DeepStack),
audio through its chunked Whisper-style audio tower; each item's rows are what vLLM 0.32's
``qwen3_omni_moe_thinker.py`` hands its language model.

- **Images**: as ``qwen.py`` makes them (the checkpoint's Qwen2-VL image processor, 16-pixel
  patches), through ``Qwen3OmniMoeVisionEncoder``: the merger's rows, then each DeepStack merger's
  on the last dimension, ``out_hidden_size * (1 + DeepStack levels)`` wide, as
  vLLM's tower returns them and its encoder cache (and so an EC connector) holds them
  (``qwen3_vl.py``'s rule); ``meta`` is ``{"image_grid_thw": [t, h, w]}``.
- **Videos**: sampled as vLLM's loader samples them for ``Qwen2VLVideoProcessor`` (the checkpoint's
  video processor: ``qwen.py``), each frame resized within the pixel range
  ``Qwen3OmniMoeProcessor`` passes at every call (``VIDEO_CALL_SIZE``: 128 to 768 merged 32-pixel
  patches a frame, outranking the video processor's saved size, as in ``qwen2_5_omni.py``); the
  same tower; ``meta`` is ``{"video_grid_thw": [t, h, w]}``.
- **Audio**: resampled to the feature extractor's rate as vLLM's parser does (``resample.py``),
  zero-padded to a whole hop (vLLM's ``_get_hf_mm_inputs``), featurised by the checkpoint's
  ``WhisperFeatureExtractor`` as the Omni processor calls it (``padding=True``: the longest item,
  here the item itself, **not** Qwen2.5-Omni's 30 s window, whose zeros change the last frames'
  log-mel; ``truncation=False``: nothing cut at 30 s), every frame kept (``frames = ceil(samples /
  hop)``, vLLM's ``audio_feature_lengths``); the tower runs over them in its own 100-frame chunks.
  N = transformers' ``_get_feat_extract_output_lengths``: 13 rows per 100 frames, then the
  remainder's; ``meta`` is ``{"audio_feature_lengths": [frames]}``.

EPD: per modality, as vLLM's parser decides. It declares ``audio_feature_lengths`` for audio (a
metadata-only item + uuid; the prefill can run without its audio tower) and no vision field ("keep
the existing raw-media fallback"), so images and videos go as pixels + uuid: vLLM's processor sizes
the placeholder from the pixels, its connector supplies the rows, and the vision tower stays built
(``tests/vllm/test_qwen3_omni_epd_modes.py`` pins all of it).

``use_audio_in_video`` (a video's sound interleaved with its frames) as for Qwen2.5-Omni: a video
item and an audio item of the same bytes, interleaved by vLLM (``Epd.audio_in_video``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from encode_client.config_layout import towers_config
from transformers import PretrainedConfig, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)

from encode_server.core.sglang_wire import Extra, SglangContract
from encode_server.core.types import AudioInfo, VideoInfo

from .base import AudioPlan, PreparedItem, VideoPlan
from .family import Epd, Family
from .hf import LoadSpec
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .qwen import OUTPUTS, video_frame_size
from .qwen2_5_omni import OmniTowers, Qwen2_5OmniEncoder, attach_call_video
from .qwen3_vl import Qwen3VisionEncoder, deepstack_width
from .qwen_video import video_grid
from .resample import check_resamplable, resample

__all__ = ["FAMILY", "VIDEO_CALL_SIZE", "Qwen3OmniEncoder", "audio_rows", "load_qwen3_omni"]

LAYOUTS: list[Layout] = [{"thinker.visual.": "visual.", "thinker.audio_tower.": "audio_tower."}]
# Qwen3OmniMoeProcessor's size for videos, passed at every call (transformers 5.19 and 5.25's
# ``_defaults["videos_kwargs"]``): it outranks the video processor's saved size.
VIDEO_CALL_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
CHUNK_FRAMES = 100  # the audio tower's chunk (2 * n_window), and the 13 rows each full one gives
CHUNK_ROWS = 13


def audio_rows(frames: int) -> int:
    """The audio tower's rows for ``frames`` log-mel frames: transformers' and vLLM's
    ``_get_feat_extract_output_lengths`` (three stride-2 convolutions per 100-frame chunk)."""
    rest = frames % CHUNK_FRAMES
    after = (rest - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (frames // CHUNK_FRAMES) * CHUNK_ROWS


class Qwen3OmniEncoder(Qwen2_5OmniEncoder):
    """Qwen2.5-Omni's two-tower encoder (each kind's items in one pass of its tower) with Qwen3-VL's
    DeepStack-packed vision rows and Qwen3-Omni's chunked audio tower and count."""

    features = Qwen3VisionEncoder.features
    audio_rows = staticmethod(audio_rows)

    def __init__(self, towers: OmniTowers, processor: Any, extractor: WhisperFeatureExtractor, spec: LoadSpec,
                 *, digest: str) -> None:
        kind = "qwen3_omni_moe"
        super().__init__(towers, processor, extractor, spec, digest=digest, kind=kind)
        # audio rows are the language model's width; hidden_size is the vision rows' (DeepStack-packed)
        self.info = replace(self.info, hidden_size=deepstack_width(towers.visual.config, kind),
                            widths={"audio": int(towers.audio_tower.config.output_dim)})

    def plan_video(self, info: VideoInfo, fps: float) -> VideoPlan:
        assert self.video is not None
        indices = self._sample(info, fps)
        size = (info.height, info.width)
        if self.video.do_resize:
            size = video_frame_size(len(indices), info.height, info.width, self.video)
        grid = video_grid(len(indices), size, self.video)
        return self._video_plan(info, indices, size, grid, {"video_grid_thw": grid})

    # -- audio: the whole file, padded to a whole hop only ---------------------------------------

    def plan_audio(self, info: AudioInfo) -> AudioPlan:
        """The whole file (``--max-audio-seconds`` bounds it), costed from its header's length."""
        check_resamplable(info.sample_rate, self.sample_rate)
        heard = info.num_samples
        resampled = math.ceil(heard * self.sample_rate / info.sample_rate)
        frames = max(1, math.ceil(resampled / self.hop_length))
        padded = frames * self.hop_length
        # decoded planar float32 (all channels), its mean, the resampled copy and the padded one; the
        # extractor's spectrogram (complex64), its power and the float64 log-mel features
        spectrum = (self.extractor.n_fft // 2 + 1) * (frames + 1) * 12
        nbytes = 4 * (heard * (info.channels + 1) + resampled + padded) + spectrum + 8 * 2 * self.n_mels * (frames + 1)
        return AudioPlan(self.sample_rate, None, audio_rows(frames), nbytes)

    def count_audio_tokens(self, num_samples: int, sample_rate: int) -> tuple[int, dict[str, Any]]:
        samples = math.ceil(num_samples * self.sample_rate / sample_rate)
        frames = math.ceil(samples / self.hop_length)
        if frames * self.hop_length <= self.extractor.n_fft // 2:  # the extractor's centred STFT cannot reflect-pad it
            raise ValueError(f"the audio ({samples} samples at {self.sample_rate} Hz) is too short to be "
                             "represented inside the model")
        return audio_rows(frames), {"audio_feature_lengths": [frames]}

    def preprocess_audio(self, waveform: Any, sample_rate: int) -> PreparedItem:
        audio = resample(waveform, sample_rate, self.sample_rate)
        tokens, meta = self.count_audio_tokens(len(audio), self.sample_rate)
        padded = np.pad(audio, (0, -len(audio) % self.hop_length))
        made = self.extractor(padded, sampling_rate=self.sample_rate, return_attention_mask=True, padding="longest",
                              truncation=False, return_tensors="pt")
        frames = int(made["attention_mask"].sum())
        if meta["audio_feature_lengths"] != [frames]:
            raise RuntimeError(f"the feature extractor heard {frames} frames, not the {meta} counted")
        features = made["input_features"][0, :, :frames].contiguous()
        return PreparedItem({"input_features": features}, tokens, tokens, meta)

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        if "audio_feature_lengths" in meta:
            return audio_rows(int(meta["audio_feature_lengths"][0]))
        return super().cost_of(num_tokens, meta)

    def _own_audio_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Qwen3-Omni's tower takes the frame counts alone."""
        return inputs


def load_qwen3_omni(files: CheckpointFiles, config: PretrainedConfig, processor: Any,
                    spec: LoadSpec) -> Qwen3OmniEncoder:
    """The thinker's vision tower (its biased patch Conv3d kept, as Qwen3-VL's) and audio tower, its
    image processor, feature extractor and video processor settings."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Qwen3-Omni model's output is its towers' features ({OUTPUTS}), not {spec.output!r}")
    towers = empty_module(
        lambda: OmniTowers(towers_config(config), spec.dtype, Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeAudioEncoder),
        spec.device, spec.dtype,
    )
    digest = load_vision_weights(towers, files, LAYOUTS)
    extractor = WhisperFeatureExtractor.from_pretrained(files.directory)
    encoder = Qwen3OmniEncoder(towers, processor, extractor, spec, digest=digest)
    attach_call_video(encoder, files, VIDEO_CALL_SIZE)
    return encoder


# vLLM 0.32's Qwen3OmniMoeThinkerMultiModalDataParser declares Qwen2.5-Omni's audio fields only
# (input_audio_features, and audio_feature_lengths as metadata), keeping raw media for images and
# videos: audio pixel-free, images and videos pixels + uuid.
FAMILY = Family(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe",),
    load=load_qwen3_omni,
    modalities=("image", "video", "audio"),
    epd=Epd(
        "pixels_uuid",
        {"audio": ("audio_feature_lengths",)},
        vllm_model="qwen3_omni_moe_thinker.py",
        modes={"audio": "pixel_free"},
        # vLLM 0.32 fails a request with metadata-only audio beside an image or a video (Epd.alone)
        alone=("audio",),
        audio_in_video=True,
    ),
    # SGLang's Omni M-RoPE needs a video's seconds per temporal group; its encoder computes
    # temporal_patch_size (2) / 2 fps, which this family's meta does not carry.
    sglang=SglangContract(
        {"image": "image_grid_thw", "video": "video_grid_thw", "audio": "audio_feature_lengths"},
        {"video": (Extra("second_per_grid_ts", "second_per_grid_ts", "float32", default=1.0),)},
        ("Qwen3OmniMoeForConditionalGeneration",),
    ),
)
