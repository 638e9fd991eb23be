"""Every audio family through the real ``--model PATH`` code path, over real HTTP and gRPC: rows
equal to the full model's, one item one hash, the token counts, and the bad-audio corpus, each
refused with its own 4xx naming the item while the server keeps answering.

vLLM's own tower is the oracle in ``tests/vllm/test_audio.py`` (every rate, FLAC, the 30 s cut);
here the full transformers model is, on 16 kHz WAVs, where no resampling is involved.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from blake3 import blake3

from encode_server.encoders import FAMILIES
from tests.audios import FORMATS, cut_header, make_audio, samples, truncated_wav, understated_flac, unknown_codec_wav
from tests.images import image_bytes
from tests.server import ServerProcess, start_server
from tests.tiny import qwen2_5_omni, qwen2_audio, qwen3_omni
from tests.tiny.records import RECORDS
from tests.videos import make_video

pytestmark = pytest.mark.integration

AUDIO_FAMILIES = sorted(f.name for f in FAMILIES if "audio" in f.modalities)


def _qwen2_audio(path: Path, waveform: np.ndarray) -> tuple[torch.Tensor, dict[str, Any]]:
    rows = qwen2_audio.reference_features(path, waveform)
    return rows, {"audio_num_tokens": [rows.shape[0]]}


# record.reference -> the full model's rows and the item's meta
REFERENCES = {"qwen2_audio": _qwen2_audio, "qwen2_5_omni": qwen2_5_omni.reference_audio_features,
              "qwen3_omni": qwen3_omni.reference_audio_features}
TAKES_IMAGES = {f.name for f in FAMILIES if "image" in f.modalities}
MAX_SECONDS = 40


@pytest.fixture(scope="module", params=AUDIO_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           server_logs: Path) -> Iterator[tuple[str, Path, ServerProcess]]:
    record = RECORDS[request.param]
    path = record.builders[record.kind](tmp_path_factory.mktemp(request.param))
    server = start_server("--model", str(path), "--dtype", "float32", "--max-wait-ms", "1",
                          "--max-audio-seconds", str(MAX_SECONDS), log_dir=server_logs)
    yield request.param, path, server
    assert server.stop() == 0, server.log()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _encode(server: ServerProcess, items: list[dict[str, Any]], path: str = "/v1/encode") -> httpx.Response:
    return httpx.post(server.url + path, json={"items": items}, timeout=120)


def _rows(item: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32).reshape(item["shape"])


def test_rows_equal_the_full_models_and_the_hash_is_the_files(family: tuple[str, Path, ServerProcess]) -> None:
    name, path, server = family
    for seconds, channels in ((1.0, 1), (3.7, 2), (12.34, 1), (31.5, 1)):
        data = make_audio(seconds, 16_000, channels, seed=int(seconds * 100))
        item = _encode(server, [{"data": _b64(data), "modality": "audio"}]).json()["items"][0]
        assert (item["status"], item["hash"]) == ("encoded", blake3(data).hexdigest())
        pcm = (samples(seconds, 16_000, channels, seed=int(seconds * 100)) * 32767).astype(np.int16)
        waveform = (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float32)
        reference, meta = REFERENCES[RECORDS[name].reference](path, waveform)
        expected = reference.numpy()
        got = _rows(item)
        assert got.shape == expected.shape, (seconds, got.shape, expected.shape)
        assert np.abs(got - expected).max() <= 1e-5 * max(1.0, float(np.abs(expected).max())), seconds
        assert item["num_tokens"] == got.shape[0] and item["meta"] == meta
        hit = _encode(server, [{"hash": item["hash"], "modality": "audio"}]).json()["items"][0]
        assert (hit["status"], hit["source"], hit["embedding"]) == ("hit", "local", item["embedding"])
        # the same bytes as an image are another entry (and a kind an audio-only family refuses)
        other = _encode(server, [{"hash": item["hash"]}])
        if name in TAKES_IMAGES:
            assert other.status_code == 200 and other.json()["items"][0]["status"] == "miss", other.text
        else:
            assert other.status_code == 400 and other.json()["error"]["type"] == "unsupported_modality"


def test_every_container_and_rate_encodes_and_counts_as_its_tokens_say(family: tuple[str, Path, ServerProcess]) -> None:
    """/v1/tokens (decoded, nothing encoded) == the encode's num_tokens and meta, for every container
    and for rates the feature extractor does not take (resampled), lengths across the 30 s window."""
    _, _, server = family
    files = [make_audio(2.0, 44_100, 2, fmt, seed=i) for i, fmt in enumerate(FORMATS) if fmt != "opus"]
    files += [make_audio(2.0, 48_000, 1, "opus"), make_audio(0.4, 8_000), make_audio(29.9, 22_050),
              truncated_wav(3.0, 0.37), make_audio(31.0, 44_100, 1, "flac")]
    items = [{"data": _b64(d), "modality": "audio"} for d in files]
    encoded = _encode(server, items).json()["items"]
    counted = _encode(server, items, "/v1/tokens").json()["items"]
    assert [(c["num_tokens"], c["meta"]) for c in counted] == [(e["num_tokens"], e["meta"]) for e in encoded]
    assert len({e["num_tokens"] for e in encoded}) >= 3
    # raw and multipart bodies say audio by their Content-Type
    raw = httpx.post(server.url + "/v1/encode", content=files[0], headers={"Content-Type": "audio/wav"}, timeout=60)
    assert raw.status_code == 200 and raw.json()["items"][0]["hash"] == encoded[0]["hash"]
    parts = httpx.post(server.url + "/v1/encode", files=[("f", ("a.flac", files[1], "audio/flac"))], timeout=60)
    assert parts.status_code == 200 and parts.json()["items"][0]["hash"] == encoded[1]["hash"]
    url = _encode(server, [{"data": "data:audio/wav;base64," + _b64(files[0])}]).json()["items"][0]
    assert url["hash"] == encoded[0]["hash"]


def test_the_client_sends_a_wav_as_audio_over_grpc_and_http(family: tuple[str, Path, ServerProcess],
                                                            tmp_path: Path) -> None:
    from encode_client import Client

    _, _, server = family
    data = make_audio(1.5, 16_000, seed=77)
    (tmp_path / "clip.wav").write_bytes(data)
    with Client(f"grpc://127.0.0.1:{server.grpc_port}") as grpc_client, Client(server.url) as http_client:
        over_grpc = grpc_client.encode([tmp_path / "clip.wav"])[0]
        over_http = http_client.encode([str(tmp_path / "clip.wav")])[0]
    assert over_grpc.hash == over_http.hash == blake3(data).hexdigest()
    assert torch.equal(torch.tensor(over_grpc.numpy()), torch.tensor(over_http.numpy()))


BAD = {
    "random bytes": (np.random.default_rng(3).bytes(4000), 400, "invalid_audio"),
    "zero length": (b"", 400, "invalid_audio"),
    "cut inside its header": (cut_header(), 400, "invalid_audio"),
    "an unknown codec": (unknown_codec_wav(), 415, "unsupported_audio"),
    # 44,101 Hz -> 16 kHz is a 7e8-tap filter bank: refused before decoding, not 5.6 GB allocated
    "an odd rate": (make_audio(0.2, 44_101), 415, "unsupported_audio"),
    "a video with no sound": (make_video(8, 4.0, 64, 48), 400, "invalid_audio"),
    "an image": (image_bytes("PNG", 32, 32), 400, "invalid_audio"),
    "too short for one row": (make_audio(0.01), 400, "invalid_audio"),
    "too long": (make_audio(MAX_SECONDS + 5, 8_000), 413, "audio_too_large"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_audio_gets_its_own_4xx_naming_the_item_and_nothing_else_is_lost(
    case: str, family: tuple[str, Path, ServerProcess]
) -> None:
    _, _, server = family
    data, status, kind = BAD[case]
    good = make_audio(1.0, seed=5)
    for path in ("/v1/encode", "/v1/tokens"):
        r = _encode(server, [{"data": _b64(good), "modality": "audio"}, {"data": _b64(data), "modality": "audio"}],
                    path)
        assert r.status_code == status, (case, r.text)
        error = r.json()["error"]
        assert (error["type"], error["index"]) == (kind, 1), (case, error)
    assert _encode(server, [{"data": _b64(good), "modality": "audio"}]).status_code == 200


def test_a_truncated_file_is_what_it_holds_and_a_header_is_read_as_libsndfile_reads_it(
    family: tuple[str, Path, ServerProcess]
) -> None:
    """A WAV cut to 1 s of its 2 s reads as the 1 s it holds (25 rows: Qwen2-Audio's 25 a second;
    Qwen3-Omni's 13 per 100 frames); a FLAC of 20 s whose header claims 1 s reads as 1 s, as vLLM's
    libsndfile reads it, and its token count (from the header, nothing decoded) is its encode's."""
    name, _, server = family
    one_second = _encode(server, [{"data": _b64(make_audio(1.0)), "modality": "audio"}], "/v1/tokens")
    assert one_second.json()["items"][0]["num_tokens"] == (13 if name == "qwen3_omni" else 25)
    for data in (truncated_wav(2.0, 0.5), understated_flac(20.0, 16_000)):
        item = {"data": _b64(data), "modality": "audio"}
        encoded = _encode(server, [item]).json()["items"][0]
        counted = _encode(server, [item], "/v1/tokens").json()["items"][0]
        assert encoded["num_tokens"] == counted["num_tokens"] == one_second.json()["items"][0]["num_tokens"], (
            encoded["num_tokens"], counted)


@pytest.fixture(scope="module")
def builtin(server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server("--grpc-port", "0", log_dir=server_logs)
    yield server
    assert server.stop() == 0, server.log()


def test_image_sizes_count_nothing_for_an_audio_only_family(family: tuple[str, Path, ServerProcess]) -> None:
    name, _, server = family
    r = httpx.post(server.url + "/v1/tokens", json={"sizes": [[64, 64]]}, timeout=30)
    if name in TAKES_IMAGES:  # Qwen2.5-Omni: images are its too
        assert r.status_code == 200 and r.json()["items"][0]["num_tokens"] > 0, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported_modality", r.text


def test_an_image_model_refuses_audio_naming_the_item(builtin: ServerProcess) -> None:
    """The built-in (image and video) model: an audio item is 400 unsupported_modality, not a miss."""
    server = builtin
    for item in ({"data": _b64(make_audio(1.0)), "modality": "audio"}, {"hash": "ab" * 32, "modality": "audio"}):
        r = _encode(server, [{"data": _b64(image_bytes("PNG", 32, 32))}, item])
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["index"]) == ("unsupported_modality", 1)
