"""Qwen2-Audio: a Whisper-style audio encoder and a linear projector; audio only.

What vLLM 0.32's ``qwen2_audio.py`` does with an audio item, done the same way here:

- the waveform (one channel, the file's rate: ``audio.py``) is resampled to the feature
  extractor's rate (16 kHz) as vLLM's parser resamples it (``resample.py``);
- ``WhisperFeatureExtractor`` (the checkpoint's, with vLLM's call: ``truncation=True``, padding to
  ``max_length``) makes ``[n_mels, 3000]`` log-mel features, 30 s, longer audio cut there, and an
  attention mask whose sum is the frames actually heard, ``ceil(samples / hop_length)``;
- the tower runs over all 3000 frames with the padded positions masked out (vLLM's
  ``_process_audio_input``: a ``-inf`` mask over the 1500 positions after the strided conv), the
  projector maps each position to the language model's width, and the first
  ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` rows are the item's: vLLM's placeholder count, at most 750.
  ``meta`` is ``{"audio_num_tokens": [N]}``: the field vLLM's parser declares, as the one-element
  list its chat parser turns into the integer tensor it requires (a bare number is refused).

So every item costs the same pass (1,500 positions), whatever its length: batches are of items.

EPD: pixel-free. vLLM's parser declares ``audio_embeds`` (values) and ``audio_num_tokens``
(metadata), so the prefill request carries ``{"audio_num_tokens": N}`` and the uuid, and the prefill
worker runs without its audio tower (``--limit-mm-per-prompt '{"audio": 0}'``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from PIL import Image
from transformers import AutoFeatureExtractor, PretrainedConfig, Qwen2AudioConfig, Qwen2AudioEncoderConfig
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

from encode_server.core.types import AudioInfo

from .base import AudioPlan, EncodedTensor, PreparedItem
from .family import Epd, Family
from .hf import HFEncoder, LoadSpec, to_encoded
from .loading import CheckpointFiles, Layout, empty_module, load_vision_weights
from .resample import check_resamplable, resample

__all__ = ["FAMILY", "Qwen2AudioEncoderAdapter", "load_qwen2_audio", "num_audio_tokens"]

OUTPUTS = ("hidden", "projected")  # "hidden" is accepted as the default and means "projected"
# transformers 5 writes ``model.audio_tower.*`` / ``model.multi_modal_projector.*``; the hub's
# checkpoints ``audio_tower.*`` / ``multi_modal_projector.*``.
LAYOUTS: list[Layout] = [{"model.audio_tower.": "audio_tower.", "model.multi_modal_projector.": "projector."},
                         {"audio_tower.": "audio_tower.", "multi_modal_projector.": "projector."}]
RESAMPLE_MARGIN_S = 0.05  # read past the window so the resampler's filter sees what vLLM's does


def num_audio_tokens(frames: int) -> int:
    """Rows for ``frames`` heard mel frames: the conv's stride 2, then the pool's (vLLM's
    ``_get_feat_extract_output_lengths``)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class _Projector(torch.nn.Module):
    """The checkpoint's ``multi_modal_projector``: one linear layer, named as there."""

    def __init__(self, d_model: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(d_model, hidden_size)


class _AudioTower(torch.nn.Module):
    """The checkpoint's audio encoder and projector, nothing of its language model."""

    def __init__(self, config: Qwen2AudioConfig) -> None:
        super().__init__()
        audio = cast(Qwen2AudioEncoderConfig, config.audio_config)
        self.config = audio
        self.audio_tower = Qwen2AudioEncoder(audio)
        self.projector = _Projector(audio.d_model, cast(PretrainedConfig, config.text_config).hidden_size)


class Qwen2AudioEncoderAdapter(HFEncoder):
    """Featurise (CPU, per item) and encode (a batch of fixed-size items) as vLLM does."""

    def __init__(self, module: _AudioTower, processor: Any, spec: LoadSpec, *, digest: str) -> None:
        super().__init__(module, processor, spec, kind="qwen2_audio", output="projected",
                         hidden_size=module.projector.linear.out_features, weights_digest=digest)
        self.tower = module
        self.sample_rate = int(processor.sampling_rate)
        self.hop_length = int(processor.hop_length)
        self.window = int(processor.n_samples)  # 30 s at 16 kHz: the features' fixed length
        self.positions = int(processor.nb_max_frames) // 2  # after the tower's strided conv

    # -- images: none -------------------------------------------------------------------------

    def preprocess(self, image: Image.Image) -> PreparedItem:
        raise ValueError("Qwen2-Audio takes audio only")

    def count_tokens(self, width: int, height: int) -> tuple[int, dict[str, Any]]:
        raise ValueError("Qwen2-Audio takes audio only")

    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        return self.positions

    # -- audio --------------------------------------------------------------------------------

    def plan_audio(self, info: AudioInfo) -> AudioPlan:
        check_resamplable(info.sample_rate, self.sample_rate)
        keep = self.window / self.sample_rate + RESAMPLE_MARGIN_S
        heard = math.ceil(keep * info.sample_rate)  # a header that only estimates the length may understate it
        if info.exact_length:
            heard = min(info.num_samples, heard)
        resampled = min(self.window, math.ceil(heard * self.sample_rate / info.sample_rate))
        features = 2 * int(self.processor.feature_size) * int(self.processor.nb_max_frames) * 4
        # decoded planar float32 (all channels), its mean, the resampled copy and the padded window
        nbytes = 4 * (heard * (info.channels + 1) + resampled + self.window) + features
        return AudioPlan(self.sample_rate, keep, self.positions, nbytes)

    def count_audio_tokens(self, num_samples: int, sample_rate: int) -> tuple[int, dict[str, Any]]:
        samples = min(self.window, math.ceil(num_samples * self.sample_rate / sample_rate))
        tokens = num_audio_tokens(math.ceil(samples / self.hop_length))
        if tokens <= 0:
            raise ValueError(f"the audio ({samples} samples at {self.sample_rate} Hz) is too short to be "
                             "represented inside the model")
        return tokens, {"audio_num_tokens": [tokens]}

    def preprocess_audio(self, waveform: Any, sample_rate: int) -> PreparedItem:
        audio = resample(waveform, sample_rate, self.sample_rate)
        made = self.processor(audio, sampling_rate=self.sample_rate, return_attention_mask=True,
                              padding="max_length", truncation=True, return_tensors="pt")
        frames = int(made["attention_mask"].sum())
        tokens, meta = self.count_audio_tokens(len(audio), self.sample_rate)
        if tokens != num_audio_tokens(frames):
            raise RuntimeError(f"the feature extractor heard {frames} frames, not the {tokens} tokens' worth counted")
        inputs = {"input_features": made["input_features"], "frames": torch.tensor([frames])}
        return PreparedItem(inputs, tokens, self.positions, meta)

    def forward(self, batch: Sequence[PreparedItem]) -> list[Any]:
        if not batch:
            return []
        features = torch.cat([item.inputs["input_features"] for item in batch]).to(self.device, dtype=self.dtype)
        frames = torch.cat([item.inputs["frames"] for item in batch]).to(self.device)
        return list(self._forward(batch, {"input_features": features, "frames": frames}))

    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        features, frames = inputs["input_features"], inputs["frames"]
        # vLLM's mask: the positions after the strided conv that no heard frame reaches are -inf
        lengths = (frames - 1) // 2 + 1
        positions = (features.shape[-1] - 2) // 2 + 1
        padded = torch.arange(positions, device=features.device)[None] >= lengths[:, None]
        mask = torch.zeros((len(batch), 1, positions, positions), dtype=self.dtype, device=features.device)
        mask.masked_fill_(padded[:, None, None, :], float("-inf"))
        hidden = self.tower.audio_tower(features, attention_mask=mask).last_hidden_state
        projected = self.tower.projector.linear(hidden)
        host = self._to_host(projected)
        return [to_encoded(host[i, : item.num_tokens]) for i, item in enumerate(batch)]


def load_qwen2_audio(files: CheckpointFiles, config: Qwen2AudioConfig, processor: Any,
                     spec: LoadSpec) -> Qwen2AudioEncoderAdapter:
    """The audio tower and projector of a Qwen2-Audio checkpoint; its feature extractor."""
    if spec.output not in OUTPUTS:
        raise ValueError(f"a Qwen2-Audio model's output is its projected features ({OUTPUTS}), not {spec.output!r}")
    module = empty_module(lambda: _AudioTower(config), spec.device, spec.dtype)
    digest = load_vision_weights(module, files, LAYOUTS)
    return Qwen2AudioEncoderAdapter(module, processor, spec, digest=digest)


FAMILY = Family(
    name="qwen2_audio",
    model_types=("qwen2_audio",),
    load=load_qwen2_audio,
    modalities=("audio",),
    epd=Epd("pixel_free", {"audio": ("audio_num_tokens",)}, vllm_model="qwen2_audio.py"),
    processor=AutoFeatureExtractor.from_pretrained,
)
