"""Per-request processor settings through EPD (issue 33), proved against vLLM: a chat's
``mm_processor_kwargs`` (Qwen2.5-VL's ``max_pixels``/``min_pixels``) through ``encode-epd-proxy`` ->
vLLM's OpenAI server (an EC consumer that keeps its tower, started with ``--trust-request-mm-kwargs``)
answers as plain vLLM answers the same chat on the pixels with the same kwargs; encode-server's
``/v1/tokens`` under the settings counts what vLLM's placeholder takes (its prompt length); one
image under two settings is two identifiers and two answers, each vLLM's own.

Each family's stack is conftest's ``family_stack`` (its encode-server and vLLM started with
``--trust-request-mm-kwargs``), shared with ``test_proxy_families.py``; the chats go through its
``trusted_proxy``. The consumer is also the oracle: the same chat sent to it straight, with its
pixels and no ``uuid``, is named by vLLM's own hash (which the store never holds), so vLLM runs its
own processor with the kwargs and its own tower.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.keys import EC_PARAMS_KEY, epd_identifier

from encode_server.core.settings import digest
from tests.vllm.conftest import REDIS_URL, metric, on_family_stacks, png, stored_value
from tests.vllm.epd_stack import FamilyStack, chat, post_chat

# Qwen2.5-VL: the family stack's Qwen2.5-VL (with a video processor, which images do not use), vLLM's
# HF processor on its default (torchvision) backend, whose pixels encode-server makes with the same
# torch operations: a resized image's pixels agree bit for bit, and so do the embeddings.
QWEN2_5 = on_family_stacks("qwen2_vl")
pytestmark = pytest.mark.timeout(600)

# 280x280 is resized to 224x224 (the checkpoint's max_pixels): 64 rows; 112x112 under these: 16.
IMAGE = png(280, 280, seed=3300)
FEWER = {"max_pixels": 112 * 112}
OTHER = {"max_pixels": 168 * 168}


@pytest.fixture
def stack(family_stack: FamilyStack) -> FamilyStack:
    """The stack of the family the test is marked with (``on_family_stacks``)."""
    return family_stack


def _answer(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """The chat's text and its prompt's length (vLLM's placeholder rows are in it)."""
    r = post_chat(url, body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"]), int(r.json()["usage"]["prompt_tokens"])


def _identifier(stack: FamilyStack, settings: dict[str, Any], data: bytes) -> str:
    """What the proxy must name the image by: the server's digest of the effective settings (an
    image's keys only: a video's fps is none of its)."""
    keys = httpx.get(stack.server.url + "/v1/model", timeout=10).json()["mm_processor_kwargs"]["keys"]
    effective = {name: key["default"] for name, key in keys.items() if "image" in key["modalities"]} | settings
    return f"p:{digest(effective)}:{mm_hash(data)}"


def _placeholder_rows(
    stack: FamilyStack, size: tuple[int, int], settings: dict[str, Any], seed: int
) -> tuple[int, int]:
    """(encode-server's rows under ``settings`` minus without, from ``/v1/tokens``; vLLM's prompt
    with them minus without, the same text: its placeholder rows with them minus without)."""
    data = png(*size, seed=seed)

    def counted(given: dict[str, Any] | None) -> int:
        body = {"sizes": [list(size)], **({"mm_processor_kwargs": given} if given else {})}
        r = httpx.post(stack.server.url + "/v1/tokens", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["items"][0]["num_tokens"])

    _, with_settings = _answer(stack.consumer["url"], chat([data], mm_processor_kwargs=settings, max_tokens=1))
    _, without = _answer(stack.consumer["url"], chat([data], max_tokens=1))
    print(f"\n{size} {settings}: encode-server {counted(settings)} rows ({counted(None)} without); vLLM's prompt "
          f"{with_settings} tokens ({without} without)")
    return counted(settings) - counted(None), with_settings - without


def _through_the_proxy(stack: FamilyStack, settings: dict[str, Any] | None, data: bytes) -> tuple[str, int, list[str]]:
    body = chat([data], **({"mm_processor_kwargs": settings} if settings else {}))
    mark = stack.relay.mark()
    text, prompt_tokens = _answer(stack.trusted_proxy.url, body)
    sent = stack.relay.since(mark)
    assert b"image_url" not in sent and b'"image_embeds"' in sent  # pixel-free: metadata + uuid only
    assert b"mm_processor_kwargs" not in sent  # the grid carries their effect
    return text, prompt_tokens, stack.relay.uuids_since(mark)


@QWEN2_5
def test_a_chat_with_max_pixels_through_the_proxy_answers_as_plain_vllm_given_the_same_kwargs(
    stack: FamilyStack,
) -> None:
    text, prompt_tokens, uuids = _through_the_proxy(stack, FEWER, IMAGE)
    assert uuids == [_identifier(stack, FEWER, IMAGE)]
    plain_text, plain_tokens = _answer(stack.consumer["url"], chat([IMAGE], mm_processor_kwargs=FEWER))
    default_text, default_tokens = _answer(stack.consumer["url"], chat([IMAGE]))
    print(f"\nmax_pixels {FEWER['max_pixels']}: proxy {text!r} ({prompt_tokens} prompt tokens), plain vLLM "
          f"{plain_text!r} ({plain_tokens}); without the kwargs {default_text!r} ({default_tokens})")
    assert (text, prompt_tokens) == (plain_text, plain_tokens)
    assert default_tokens - plain_tokens == 64 - 16  # the setting took effect on both sides


@QWEN2_5
@pytest.mark.parametrize(
    ("size", "settings"),
    [((280, 280), FEWER), ((280, 280), OTHER), ((640, 480), FEWER), ((100, 700), FEWER),
     ((56, 56), {"min_pixels": 112 * 112}), ((300, 200), {"min_pixels": 112 * 112, "max_pixels": 140 * 140})],
)
def test_tokens_under_the_settings_equal_vllms_placeholder_count_with_them(
    stack: FamilyStack, size: tuple[int, int], settings: dict[str, Any]
) -> None:
    """vLLM's placeholder count, read from its prompt length: the prompt with the settings minus
    the prompt without is the rows with them minus the rows without (the rest of the prompt is the
    same text), and encode-server's count without them equals vLLM's (``test_tokens``)."""
    ours, vllms = _placeholder_rows(stack, size, settings, seed=3310)
    assert ours == vllms != 0


@QWEN2_5
def test_one_image_under_two_settings_gets_two_identifiers_and_two_answers_each_vllms(stack: FamilyStack) -> None:
    """The collision the key's settings digest prevents: were the identifier the bytes' alone, the
    second setting would be served the first's embedding (vLLM's encoder cache and the store both
    keep an item under its identifier), with the first's row count."""
    data = png(280, 280, seed=3320)
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    encoded = metric(text, "encode_server_items_total", status="encoded")
    answers = {}
    for name, settings in (("fewer", FEWER), ("other", OTHER), ("default", None), ("fewer again", FEWER)):
        got_text, got_tokens, uuids = _through_the_proxy(stack, settings, data)
        plain = _answer(stack.consumer["url"], chat([data], **({"mm_processor_kwargs": settings} if settings else {})))
        print(f"\n{name}: proxy {got_text!r} ({got_tokens}), plain vLLM {plain[0]!r} ({plain[1]}), uuid {uuids}")
        assert (got_text, got_tokens) == plain, name
        answers[name] = (got_text, got_tokens, uuids[0])
    identifiers = {answers[n][2] for n in ("fewer", "other", "default")}
    assert len(identifiers) == 3 and answers["default"][2] == mm_hash(data)  # the defaults: today's identifier
    assert answers["fewer again"] == answers["fewer"]
    assert len({answers[n][1] for n in ("fewer", "other", "default")}) == 3  # three row counts
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    assert metric(text, "encode_server_items_total", status="encoded") == encoded + 3  # the repeat was a hit


@QWEN2_5
def test_settings_the_family_refuses_are_a_400_naming_the_key_and_nothing_reaches_vllm(stack: FamilyStack) -> None:
    mark = stack.relay.mark()
    for settings, param in (({"max_pixel": 5}, "mm_processor_kwargs.max_pixel"),
                            ({"max_pixels": "5"}, "mm_processor_kwargs.max_pixels")):
        r = post_chat(stack.trusted_proxy.url, chat([IMAGE], mm_processor_kwargs=settings))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert stack.relay.since(mark) == b""


# -- InternVL: pixels + uuid, so vLLM's processor sees the pixels and must get the same kwargs -------

TILES = {"max_patches": 2}
MORE_TILES = {"min_patches": 3, "max_patches": 4}


# Each pixels + uuid family that declares settings: two of them, then the first again (a hit).
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
FEWER_CROPS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 2,
               "pan_and_scan_min_ratio_to_activate": 1.0}
PIXELS_SETTINGS = {"internvl": (TILES, MORE_TILES), "gemma3": (PAN_AND_SCAN, FEWER_CROPS)}
WIDE = {"internvl": (300, 200), "gemma3": (600, 100)}  # Gemma 3: 4 crops under the first, 2 under the second


def test_every_pixels_uuid_family_that_declares_settings_is_proven_here() -> None:
    from encode_server.encoders import FAMILIES

    taking = {f.name for f in FAMILIES if f.epd is not None and f.epd.mode == "pixels_uuid"
              and any("image" in setting.modalities for setting in f.settings)}
    assert taking == set(PIXELS_SETTINGS)


@on_family_stacks(*sorted(PIXELS_SETTINGS))
def test_a_pixels_uuid_familys_settings_through_the_proxy_answer_as_plain_vllm_given_the_same_kwargs(
    stack: FamilyStack,
) -> None:
    """A pixels + uuid family (InternVL's tile range, Gemma 3's pan-and-scan): vLLM's processor
    sizes the image under the kwargs (so they go on with the pixels) and hashes its uuid with them;
    the proxy names the settings' entry in ``ec_transfer_params``, the connector reads it, and the
    answer (text and prompt length) is plain vLLM's with the same kwargs. Two settings: two entries,
    two answers (two prompt lengths), each vLLM's; the repeat is a hit."""
    name = stack.family.name
    data = png(*WIDE[name], seed=3330)
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    encoded = metric(text, "encode_server_items_total", status="encoded")
    first, second = PIXELS_SETTINGS[name]
    answers = []
    for settings in (first, second, first):
        body = chat([data], mm_processor_kwargs=settings)
        mark = stack.relay.mark()
        got = _answer(stack.trusted_proxy.url, body)
        sent = stack.relay.since(mark)
        identifier = _identifier(stack, settings, data)
        assert stack.relay.uuids_since(mark) == [identifier]
        assert b"image_url" in sent and b"mm_processor_kwargs" in sent
        assert f'"ec_transfer_params": {{"encode_server": {{"items": {{"image": ["{identifier}"]}}}}}}'.encode() in sent
        plain = _answer(stack.consumer["url"], body)
        print(f"\n{name} {settings}: proxy {got}, plain vLLM {plain}")
        assert got == plain
        answers.append(got)
    assert answers[0][1] != answers[1][1]  # the settings took effect: two row counts
    text = httpx.get(stack.server.url + "/metrics", timeout=10).text
    assert metric(text, "encode_server_items_total", status="encoded") == encoded + 2  # the repeat was a hit


@on_family_stacks("internvl")
@pytest.mark.parametrize(("size", "settings"), [((300, 200), TILES), ((300, 200), MORE_TILES), ((30, 400), TILES),
                                                 ((56, 56), {"min_patches": 2})])
def test_internvls_tokens_under_a_tile_range_equal_vllms_placeholder_count(
    stack: FamilyStack, size: tuple[int, int], settings: dict[str, Any]
) -> None:
    ours, vllms = _placeholder_rows(stack, size, settings, seed=3340)
    assert ours == vllms != 0


@on_family_stacks("internvl")
def test_vllm_hashes_a_uuid_with_the_requests_kwargs_and_reads_the_entry_the_proxy_names(stack: FamilyStack) -> None:
    """Why the proxy names the entry in ``ec_transfer_params``, measured: an image handed off under
    a tile range, sent to vLLM with its pixels, the kwargs and the identifier of the entry, with
    zeros stored there, answers as plain vLLM on the pixels: vLLM 0.32 asked its connector for the
    uuid hashed with the kwargs (``ProcessorInputs.get_mm_hashes``), which no store holds, and ran
    its own tower. Another image's same request with ``ec_transfer_params`` naming its entry answers
    otherwise: the connector read the zeros. (Another image: vLLM's encoder cache may still hold the
    first one's rows under the hashed identifier, and would not ask the connector again.)"""
    answers = []
    for seed, named_by_params in ((3350, False), (3351, True)):
        data = png(300, 200, seed=seed)
        body = chat([data], mm_processor_kwargs=TILES)
        plain = _answer(stack.consumer["url"], body)
        with Client(stack.server.url, response="json", timeout=60) as client:
            (result,) = client.hand_off([data], mm_processor_kwargs=TILES)
            fingerprint = str(client.model()["fingerprint"])
            (embedding,) = client.encode([data], mm_processor_kwargs=TILES)
        assert result.key is not None
        identifier = epd_identifier(result.key, mm_hash(data))
        assert identifier == _identifier(stack, TILES, data)
        zeros = stored_value(np.zeros_like(embedding.numpy()), fingerprint, result.hash, result.meta)
        redis.Redis.from_url(REDIS_URL).set(result.key, zeros)
        named = copy.deepcopy(body)
        named["messages"][0]["content"][0]["uuid"] = identifier
        if named_by_params:
            named["ec_transfer_params"] = {EC_PARAMS_KEY: {"items": {"image": [identifier]}}}
        answers.append((_answer(stack.consumer["url"], named), plain))
    (unnamed, plain), (read, plain_other) = answers
    assert unnamed == plain, "vLLM read the uuid as given: the proxy's list is not needed"
    assert read[0] != plain_other[0], "the connector did not read the entry the list names"


# -- Qwen3-VL: pixel-free like Qwen2.5-VL, its processor's factor 32 ---------------------------------


@on_family_stacks("qwen3_vl")
def test_qwen3_vl_max_pixels_through_the_proxy_answers_as_plain_vllm_with_the_kwargs(stack: FamilyStack) -> None:
    data = png(256, 256, seed=3360)  # 64 rows under the checkpoint's max_pixels; 16 under 128x128
    settings = {"max_pixels": 128 * 128}
    text, prompt_tokens, uuids = _through_the_proxy(stack, settings, data)
    assert uuids == [_identifier(stack, settings, data)]
    plain = _answer(stack.consumer["url"], chat([data], mm_processor_kwargs=settings))
    default = _answer(stack.consumer["url"], chat([data]))
    print(f"\nqwen3_vl max_pixels {settings['max_pixels']}: proxy {text!r} ({prompt_tokens}), plain vLLM {plain[0]!r} "
          f"({plain[1]}); without the kwargs ({default[1]})")
    assert (text, prompt_tokens) == plain
    assert default[1] - plain[1] == 64 - 16


@on_family_stacks("qwen3_vl")
@pytest.mark.parametrize(
    ("size", "settings"),
    [((256, 256), {"max_pixels": 96 * 96}), ((300, 200), {"max_pixels": 64 * 64}),
     ((64, 64), {"min_pixels": 128 * 128})],
)
def test_qwen3_vl_tokens_under_the_settings_equal_vllms_placeholder_count(
    stack: FamilyStack, size: tuple[int, int], settings: dict[str, Any]
) -> None:
    ours, vllms = _placeholder_rows(stack, size, settings, seed=3370)
    assert ours == vllms != 0
