"""The Qwen2.5-Omni thinker: images and videos through its Qwen2.5-VL-style vision tower, audio
through its Whisper-style audio tower; each item's rows are what vLLM 0.32's
``qwen2_5_omni_thinker.py`` hands its language model.

- **Images**: as ``qwen.py`` makes them (the checkpoint's image processor, its torchvision backend's
  resize and normalisation), through ``Qwen2_5OmniVisionEncoder`` and its merger; ``meta`` is
  ``{"image_grid_thw": [t, h, w]}``.
- **Videos**: sampled as vLLM's loader samples them for ``Qwen2VLVideoProcessor`` (``qwen.py``),
  each frame resized within the pixel range ``Qwen2_5OmniProcessor`` passes at every call
  (``VIDEO_CALL_SIZE``: 128 to 768 merged patches a frame, over whatever the video processor saved,
  as transformers merges a processor's call defaults); ``meta`` is ``video_grid_thw`` and
  ``second_per_grid_ts``, which the Omni processor computes as ``temporal_patch_size / fps`` with
  the ``fps`` vLLM does not pass (2.0): 1.0 s per group, whatever the file's rate.
- **Audio**: resampled to the feature extractor's rate as vLLM's parser does (``resample.py``),
  featurised by the checkpoint's ``WhisperFeatureExtractor`` as vLLM calls it through the Omni
  processor (padding to the 30 s window, an attention mask, and ``truncation=False``: vLLM's
  text setting reaches the extractor too, so unlike Qwen2-Audio nothing is cut at 30 s; the file is
  bounded by ``--max-audio-seconds``), and only the heard frames kept (vLLM's
  ``_postprocess_hf_mm_data``); the audio tower runs over them in its own ``n_window`` chunks (no
  padded 30 s pass), pools and projects. N = ``((frames - 1) // 2 + 1 - 2) // 2 + 1``, vLLM's
  placeholder count (25 a second); ``meta`` is ``{"audio_feature_lengths": [frames]}``.

EPD: pixel-free for all three. vLLM's parser declares Qwen2-VL's ``image_grid_thw`` and
``video_grid_thw`` and, for audio, ``input_audio_features`` (values) and ``audio_feature_lengths``
(metadata, from which it counts the placeholder), so the prefill worker takes metadata + uuid and
can run without either tower.

``use_audio_in_video`` (a video's own sound interleaved with its frames in one placeholder) is the
prompt's business, not an item's: the video's rows and its sound's rows are what they are alone,
vLLM interleaves them. So encode-server takes the video as a video item and its sound as an audio
item of the same bytes (the audio decoder reads a video container's first sound track), and
refuses the key on an item (a 4xx naming it); the EPD path hands off both and names both
(``Epd.audio_in_video``, ``encode_client.epd``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from encode_client.config_layout import towers_config
from transformers import PretrainedConfig, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniVisionEncoder,
)

from encode_server.core.errors import EncodeServerError
from encode_server.core.types import AudioInfo, VideoInfo

from .audio_chunks import ChunkPlan
from .base import AudioPlan, EncodedTensor, PreparedItem, VideoPlan
from .family import Epd, Family
from .hf import LoadSpec, architecture, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .qwen import OUTPUTS, VIDEO_DEFAULTS, QwenVisionEncoder, as_patch_linear, attach_video, video_frame_size
from .qwen2_audio import num_audio_tokens
from .qwen_video import video_grid
from .resample import check_resamplable, resample
from .varlen import segments, use_varlen

__all__ = ["FAMILY", "VIDEO_CALL_SIZE", "OmniTowers", "Qwen2_5OmniEncoder", "attach_call_video", "load_qwen2_5_omni"]

# The hub's checkpoints (the whole model: thinker, talker, token2wav) keep the thinker under ``thinker.``.
LAYOUTS: list[Layout] = [{"thinker.visual.": "visual.", "thinker.audio_tower.": "audio_tower."}]
# Qwen2_5OmniProcessor's size for videos, passed at every call (transformers 5.19's
# ``Qwen2_5OmniProcessorKwargs._defaults["videos_kwargs"]``, 5.25's ``videos_kwargs``): it outranks
# the video processor's saved size. vLLM replaces it only for a request's own pixel settings.
VIDEO_CALL_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
VIDEO_FPS = 2.0  # the fps the Omni processor assumes for second_per_grid_ts when none is passed (vLLM's case)


class OmniTowers(torch.nn.Module):
    """An Omni thinker's two towers, nothing of its language model (nor the talker's): transformers'
    ``vision`` and ``audio`` encoder classes (Qwen2.5-Omni's by default, Qwen3-Omni's there)."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, vision: Any = Qwen2_5OmniVisionEncoder,
                 audio: Any = Qwen2_5OmniAudioEncoder) -> None:
        super().__init__()
        self.visual = vision._from_config(config.vision_config, dtype=dtype)
        self.audio_tower = audio._from_config(config.audio_config, dtype=dtype)


class Qwen2_5OmniEncoder(QwenVisionEncoder):
    """Images and videos as the Qwen2.5-VL encoder makes them, audio through the audio tower.

    An audio item's ``inputs`` are its heard features (``input_features``: ``[n_mels, frames]``), a
    vision item's the patch rows and grid: ``forward`` runs each kind's items in one pass of its
    tower. ``cost_tokens`` of audio is its positions after the strided conv (what the tower attends over)."""

    def __init__(self, towers: OmniTowers, processor: Any, extractor: WhisperFeatureExtractor, spec: LoadSpec,
                 *, digest: str, kind: str = "qwen2_5_omni") -> None:
        super().__init__(towers.visual, processor, spec, kind=kind, digest=digest)
        self.audio_tower = towers.audio_tower
        self.extractor = extractor
        self.sample_rate = int(extractor.sampling_rate)
        self.hop_length = int(extractor.hop_length)
        self.window = int(extractor.n_samples)  # 30 s at 16 kHz: what the extractor pads to
        self.n_mels = int(extractor.feature_size)
        self.audio_plan = ChunkPlan(self.audio_tower)
        if self.audio_plan.supported:
            use_varlen(self.audio_tower)
        audio = {"feature_extractor": extractor.to_dict()}
        self.info = replace(
            self.info, num_parameters=sum(p.numel() for p in towers.parameters()),
            architecture={"vision": self.info.architecture, "audio": architecture(towers.audio_tower)},
            preprocessing={**self.info.preprocessing, **audio},
        )

    # -- videos: the Omni processor's frame size and seconds per group ---------------------------

    def plan_video(self, info: VideoInfo, fps: float) -> VideoPlan:
        assert self.video is not None
        indices = self._sample(info, fps)
        size = (info.height, info.width)
        if self.video.do_resize:
            size = video_frame_size(len(indices), info.height, info.width, self.video)
        grid = video_grid(len(indices), size, self.video)
        meta = {"video_grid_thw": grid, "second_per_grid_ts": self.video.temporal_patch_size / VIDEO_FPS}
        return self._video_plan(info, indices, size, grid, meta)

    # -- audio ------------------------------------------------------------------------------------

    def plan_audio(self, info: AudioInfo) -> AudioPlan:
        """The whole file (no window: ``--max-audio-seconds`` bounds it), costed from its header's
        length (an estimated one's bound: ``kinds.plan_audio``)."""
        check_resamplable(info.sample_rate, self.sample_rate)
        heard = info.num_samples
        resampled = math.ceil(heard * self.sample_rate / info.sample_rate)
        padded = max(self.window, resampled)
        frames = padded // self.hop_length + 1
        # decoded planar float32 (all channels), its mean, the resampled copy and the padded one; the
        # extractor's spectrogram (complex64), its power and the float64 log-mel features
        spectrum = (self.extractor.n_fft // 2 + 1) * frames * 12
        nbytes = 4 * (heard * (info.channels + 1) + resampled + padded) + spectrum + 8 * 2 * self.n_mels * frames
        return AudioPlan(self.sample_rate, None, (max(1, self._frames(resampled)) - 1) // 2 + 1, nbytes)

    def _frames(self, samples: int) -> int:
        """The mel frames the extractor marks heard for ``samples`` at its rate, as vLLM calls it
        (``truncation=False``: its processor's text setting reaches the extractor too): within the
        30 s window every frame a sample reaches, past it the frames of the unpadded waveform."""
        return math.ceil(samples / self.hop_length) if samples <= self.window else samples // self.hop_length

    def count_audio_tokens(self, num_samples: int, sample_rate: int) -> tuple[int, dict[str, Any]]:
        samples = math.ceil(num_samples * self.sample_rate / sample_rate)
        frames = self._frames(samples)
        tokens = num_audio_tokens(frames)
        if tokens <= 0:
            raise ValueError(f"the audio ({samples} samples at {self.sample_rate} Hz) is too short to be "
                             "represented inside the model")
        return tokens, {"audio_feature_lengths": [frames]}

    def preprocess_audio(self, waveform: Any, sample_rate: int) -> PreparedItem:
        audio = resample(waveform, sample_rate, self.sample_rate)
        made = self.extractor(audio, sampling_rate=self.sample_rate, return_attention_mask=True,
                              padding="max_length", truncation=False, return_tensors="pt")
        frames = int(made["attention_mask"].sum())
        tokens, meta = self.count_audio_tokens(len(audio), self.sample_rate)
        if meta["audio_feature_lengths"] != [frames]:
            raise RuntimeError(f"the feature extractor heard {frames} frames, not the {meta} counted")
        features = made["input_features"][0, :, :frames].contiguous()
        return PreparedItem({"input_features": features}, tokens, (frames - 1) // 2 + 1, meta)

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        if "audio_feature_lengths" in meta:
            return (int(meta["audio_feature_lengths"][0]) - 1) // 2 + 1
        return super().cost_of(num_tokens, meta)

    def split(self, prepared: PreparedItem, max_cost: int) -> list[PreparedItem]:
        if "input_features" in prepared.inputs:
            return [prepared]  # an audio item is one pass
        return super().split(prepared, max_cost)

    # -- the pass: each kind's items through its tower --------------------------------------------

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        audio = [i for i, item in enumerate(batch) if "input_features" in item.inputs]
        if not audio:
            return super().forward(batch)
        vision = [i for i in range(len(batch)) if i not in set(audio)]
        out: list[EncodedTensor | EncodeServerError | None] = [None] * len(batch)
        for indices, results in ((audio, self._forward_audio([batch[i] for i in audio])),
                                 (vision, super().forward([batch[i] for i in vision]))):
            for i, result in zip(indices, results, strict=True):
                out[i] = result
        return [result for result in out if result is not None]

    def audio_rows(self, frames: int) -> int:
        """The audio tower's rows for an item of ``frames`` log-mel frames."""
        return num_audio_tokens(frames)

    def _forward_audio(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor]:
        """vLLM's ``_process_audio_input``: the items' heard frames in one pass of the tower, its rows
        split back by each item's count. The pass's layout (the padded chunks, their rows, the
        attention's segments) is made on the host from the frame counts (``audio_chunks.py``), so
        the pass asks the device for nothing."""
        features = [item.inputs["input_features"] for item in batch]
        plan = self.audio_plan.inputs(features, self.device, self.dtype)
        keywords = plan.kwargs if self.audio_plan.supported else self._own_audio_inputs(plan.kwargs)
        with torch.inference_mode(), segments(plan.layouts):
            rows = self.audio_tower(**keywords).last_hidden_state
        host = self._to_host(rows)
        return [to_encoded(part) for part in torch.split(host, [self.audio_rows(f.shape[-1]) for f in features])]

    def _own_audio_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """For a tower that makes its own layout (a transformers without precomputed audio inputs):
        the lengths after its convolutions beside the frame counts, as vLLM passes them."""
        after_cnn, _ = self.audio_tower._get_feat_extract_output_lengths(inputs["feature_lens"])
        return {**inputs, "aftercnn_lens": after_cnn}


def load_qwen2_5_omni(files: CheckpointFiles, config: PretrainedConfig, processor: Any,
                      spec: LoadSpec) -> Qwen2_5OmniEncoder:
    """The thinker's vision and audio towers (its bias-free patch Conv3d as ``PatchLinear``, as
    ``qwen.py``'s), its image processor, feature extractor and video processor settings."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Qwen2.5-Omni model's output is its towers' features ({OUTPUTS}), not {spec.output!r}")
    towers = empty_module(lambda: OmniTowers(towers_config(config), spec.dtype), spec.device, spec.dtype)
    digest = load_vision_weights(towers, files, LAYOUTS)
    as_patch_linear(towers.visual)
    extractor = WhisperFeatureExtractor.from_pretrained(files.directory)
    encoder = Qwen2_5OmniEncoder(towers, processor, extractor, spec, digest=digest)
    attach_call_video(encoder, files, VIDEO_CALL_SIZE)
    return encoder


def attach_call_video(encoder: QwenVisionEncoder, files: CheckpointFiles, size: dict[str, int]) -> None:
    """The video settings an Omni processor's call uses: what the checkpoint saved, under the
    ``size`` the call itself passes (which outranks a saved ``min_pixels`` / ``max_pixels``)."""
    saved = dict(files.video_processor_config(or_image_config=True) or {})
    for key in ("min_pixels", "max_pixels"):
        saved.pop(key, None)
    attach_video(encoder, {**saved, "size": size}, VIDEO_DEFAULTS)


FAMILY = Family(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni",),
    load=load_qwen2_5_omni,
    modalities=("image", "video", "audio"),
    epd=Epd(
        "pixel_free",
        {"image": ("image_grid_thw",), "video": ("video_grid_thw",), "audio": ("audio_feature_lengths",)},
        vllm_model="qwen2_5_omni_thinker.py",
        tensors={"video": {"second_per_grid_ts": "float32"}},
        audio_in_video=True,
    ),
)
# No ``sglang``: SGLang 0.5.23 names Qwen2_5OmniForConditionalGeneration on its encoder-disaggregation
# list, but has no model or processor for Qwen2.5-Omni (its checkpoints say Qwen2_5OmniModel): its
# language-only prefill cannot start for it, whatever the encoder (tests/sglang/test_families.py).
