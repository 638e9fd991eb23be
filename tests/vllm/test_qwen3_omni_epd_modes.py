"""What vLLM 0.32's Qwen3-Omni-MoE thinker (``qwen3_omni_moe_thinker.py``) lets an E supply, run on
a tiny checkpoint (``tests/tiny/qwen3_omni.py``): the facts a Qwen3-Omni family's EPD contract must
follow, pinned so that a vLLM upgrade that changes them fails here first.

- **Audio is pixel-free**: the parser declares ``input_audio_features`` (values) and
  ``audio_feature_lengths`` (metadata), so an EC consumer takes a metadata-only audio item + uuid,
  sizes its placeholder from ``audio_feature_lengths`` and runs without its audio tower (limit 0:
  not built). Its placeholder count is transformers' ``_get_feat_extract_output_lengths`` (13 rows
  per 100-frame chunk) of the frames the feature extractor hears, padded to the longest item (the
  Omni processor's ``padding=True``), not to Qwen2.5-Omni's 30 s window.
- **Images and videos are pixels + uuid**: the parser declares no vision fields ("keep the existing
  raw-media fallback"), so a metadata-only image or video item is refused; an image with its uuid
  is sized from its pixels and its rows (DeepStack: ``out_hidden_size x (1 + levels)``) come from
  the connector. The vision tower stays built.
- **Tower-free only without images**: an EC consumer with every limit 0 builds neither tower and
  still takes metadata-only audio, but refuses any image (its pixels must reach vLLM's processor);
  a consumer that serves images keeps its vision tower (audio 0, image > 0) and drops the audio
  tower. (Without an EC connector, every limit 0 makes vLLM treat the thinker as text-only.)

vLLM's own ``ECExampleConnector`` (a directory of safetensors files, one per uuid) stands for the
shared tier: this is vLLM's behaviour, not encode-server's.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.audios import make_audio
from tests.tiny.qwen3_omni import make_tiny_qwen3_omni
from tests.vllm.conftest import SharedEngine, engine, model_runner, on_family_stacks, png, tiny_checkpoint

# Plain vLLM is the family's engine (conftest's ``family_engine``: both towers, every limit 1, 2048
# positions; an EC consumer of encode-server's store, which never holds these uuids, so its own
# towers encode every item), shared with test_qwen3_omni.py and test_image_families.py; the
# consumers here, on the example connector, are this module's own.
pytestmark = on_family_stacks("qwen3_omni")
MAX_MODEL_LEN = 2048  # the family engine's, so the consumers answer on the same positions
AUDIO = [(2.0, 16_000), (12.34, 16_000), (2.5, 44_100), (1.23, 8_000)]
IMAGE = (150, 100)
TOKEN = {"audio": "<|audio_pad|>", "image": "<|image_pad|>"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_qwen3_omni)


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "describe the image"}]}]


def _greedy(llm: Any, part: dict[str, Any]) -> tuple[list[int], list[int]]:
    from vllm import SamplingParams

    out = llm.chat(_chat(part), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids), list(out[0].prompt_token_ids)


def _heard_frames(data: bytes, rate: int, extractor: Any) -> int:
    """The frames the Omni processor's feature extractor call hears (``padding=True``: the longest
    item, no 30 s window), on vLLM's resampled waveform."""
    import io
    import wave

    import numpy as np
    from vllm.multimodal.audio import AudioResampler

    with wave.open(io.BytesIO(data)) as w:
        waveform = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768
    if rate != extractor.sampling_rate:
        waveform = AudioResampler(target_sr=extractor.sampling_rate).resample(waveform, orig_sr=rate)
    made = extractor(waveform, sampling_rate=extractor.sampling_rate, return_attention_mask=True, padding=True,
                     truncation=False, return_tensors="np")
    return int(made["attention_mask"].sum())


@pytest.fixture(scope="module")
def plain(checkpoint: Path, family_engine: SharedEngine) -> dict[str, Any]:
    """vLLM with both towers on the files: each item's rows (under its uuid), placeholder count and
    greedy tokens."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(checkpoint)
    out: dict[str, Any] = {}
    llm = family_engine.llm
    llm.llm_engine.reset_encoder_cache()  # these uuids are this module's: vLLM's towers encode them here
    tokenizer = llm.get_tokenizer()
    for i, (seconds, rate) in enumerate(AUDIO):
        data = make_audio(seconds, rate, 1, "wav", seed=i)
        part = {"type": "audio_url", "audio_url": {"url": _url("audio/wav", data)}, "uuid": f"audio-{i}"}
        greedy, prompt = _greedy(llm, part)
        out[f"audio-{i}"] = {
            "rows": model_runner(llm).encoder_cache[f"audio-{i}"].float().cpu().clone(),
            "count": prompt.count(tokenizer.convert_tokens_to_ids(TOKEN["audio"])),
            "frames": _heard_frames(data, rate, extractor), "greedy": greedy,
        }
    data = png(*IMAGE, seed=0)
    part = {"type": "image_url", "image_url": {"url": _url("image/png", data)}, "uuid": "image-0"}
    greedy, prompt = _greedy(llm, part)
    out["image-0"] = {"rows": model_runner(llm).encoder_cache["image-0"].float().cpu().clone(), "data": data,
                      "count": prompt.count(tokenizer.convert_tokens_to_ids(TOKEN["image"])), "greedy": greedy}
    return out


@pytest.fixture(scope="module")
def consumer_config(plain: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's example EC connector, consumer side, over a directory holding plain vLLM's rows (and,
    under ``zeros-*``, zeros of their shape)."""
    import torch
    from safetensors.torch import save_file

    store = tmp_path_factory.mktemp("qwen3-omni-ec")
    for name, item in plain.items():
        for uuid, rows in ((name, item["rows"]), (f"zeros-{name}", torch.zeros_like(item["rows"]))):
            (store / uuid).mkdir()
            save_file({"ec_cache": rows.contiguous()}, store / uuid / "encoder_cache.safetensors")
    return {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"shared_storage_path": str(store)}}


@pytest.fixture(scope="module")
def consumer(checkpoint: Path, consumer_config: dict[str, Any]) -> Iterator[Any]:
    """The EC consumer a Qwen3-Omni deployment can run: audio limit 0, image limit 1."""
    with engine(checkpoint, consumer_config, limit_mm_per_prompt={"audio": 0, "image": 1, "video": 0},
                max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def _tower_parameters(llm: Any) -> dict[str, int]:
    model = model_runner(llm).get_model()
    return {tower: sum(p.numel() for name, p in model.named_parameters() if name.startswith(f"{tower}."))
            for tower in ("visual", "audio_tower")}


def test_audio_placeholders_are_the_chunked_count_of_the_heard_frames(plain: dict[str, Any]) -> None:
    """vLLM's audio placeholder count is transformers' Qwen3-Omni count of the frames its extractor
    hears unpadded (13 rows per 100 frames, then the remainder's), and its rows are that many."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    for i, (seconds, rate) in enumerate(AUDIO):
        item = plain[f"audio-{i}"]
        expected = int(_get_feat_extract_output_lengths(item["frames"]))
        print(f"\n{seconds} s at {rate} Hz: {item['frames']} frames, {item['count']} placeholders")
        assert item["count"] == expected == item["rows"].shape[0], (seconds, rate, item["count"], expected)


def test_audio_is_pixel_free_and_the_consumer_runs_without_its_audio_tower(
    consumer: Any, plain: dict[str, Any]
) -> None:
    """Audio limit 0: no audio tower built, the vision tower kept. A metadata-only audio item
    (``audio_feature_lengths``) + uuid answers as plain vLLM on the file; zeros under another uuid
    change the answer."""
    towers = _tower_parameters(consumer)
    assert towers["audio_tower"] == 0 < towers["visual"], towers
    for i in range(len(AUDIO)):
        item = plain[f"audio-{i}"]
        meta = {"audio_feature_lengths": [item["frames"]]}
        greedy, _ = _greedy(consumer, {"type": "audio_embeds", "audio_embeds": meta, "uuid": f"audio-{i}"})
        assert greedy == item["greedy"], (AUDIO[i], greedy, item["greedy"])
    item = plain["audio-0"]
    zeros, _ = _greedy(consumer, {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [item["frames"]]},
                                  "uuid": "zeros-audio-0"})
    assert zeros != item["greedy"], "zeros under the uuid did not change the answer"


def test_images_are_pixels_and_uuid(consumer: Any, plain: dict[str, Any]) -> None:
    """A metadata-only image or video item is refused (the parser declares no vision field, so its
    chat parser takes no grid as metadata); the
    image's pixels + uuid answer as plain vLLM with the connector's rows (DeepStack's width), and
    zeros under another uuid change the answer."""
    from vllm.exceptions import VLLMValidationError

    item = plain["image-0"]
    assert item["rows"].shape[1] == 2 * 64  # out_hidden_size x (1 + one DeepStack level)
    for kind, meta in (("image", {"image_grid_thw": [1, 6, 10]}), ("video", {"video_grid_thw": [1, 6, 10]})):
        with pytest.raises(VLLMValidationError, match=f"only supported for metadata: {kind}_grid_thw"):
            _greedy(consumer, {"type": f"{kind}_embeds", f"{kind}_embeds": meta, "uuid": f"meta-{kind}"})
    url = _url("image/png", item["data"])
    greedy, _ = _greedy(consumer, {"type": "image_url", "image_url": {"url": url}, "uuid": "image-0"})
    assert greedy == item["greedy"]
    zeros, _ = _greedy(consumer, {"type": "image_url", "image_url": {"url": url}, "uuid": "zeros-image-0"})
    assert zeros != item["greedy"], "zeros under the uuid did not change the answer"


def test_an_audio_only_consumer_runs_without_either_tower(
    checkpoint: Path, plain: dict[str, Any], consumer_config: dict[str, Any]
) -> None:
    """Every limit 0 on an EC consumer: neither tower built, metadata-only audio still answers as
    plain vLLM, and an image (pixels + uuid) is refused by the limit: a consumer drops its vision
    tower only if it serves no image or video."""
    from vllm.exceptions import VLLMValidationError

    meta = {"audio_feature_lengths": [plain["audio-0"]["frames"]]}
    url = _url("image/png", plain["image-0"]["data"])
    with engine(checkpoint, consumer_config, limit_mm_per_prompt={"audio": 0, "image": 0, "video": 0},
                max_model_len=MAX_MODEL_LEN) as llm:
        assert _tower_parameters(llm) == {"visual": 0, "audio_tower": 0}
        greedy, _ = _greedy(llm, {"type": "audio_embeds", "audio_embeds": meta, "uuid": "audio-0"})
        assert greedy == plain["audio-0"]["greedy"]
        with pytest.raises(VLLMValidationError, match="At most 0 image"):
            _greedy(llm, {"type": "image_url", "image_url": {"url": url}, "uuid": "image-0"})
