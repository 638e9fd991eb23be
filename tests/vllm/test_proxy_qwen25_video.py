"""Qwen2.5-VL videos through the EPD proxy, proven by vLLM's OpenAI server: client -> encode-epd-proxy
-> a tower-free EC consumer (``EncodeServerECConnector``) serving a tiny Qwen2.5-VL, with
encode-server and Redis beside them, a recording relay in front of vLLM; plain vLLM with its tower
(its own loader: OpenCV's FFmpeg, 2 fps) is the oracle.

Qwen2.5-VL's M-RoPE scales a video's temporal positions by ``second_per_grid_ts``, which vLLM 0.32's
parser does not declare: its chat parser refuses it as a JSON array, and without it vLLM assumes
1.0 s per group. The proxy sends it as a tensor string (the contract's ``tensors``), so a clip
sampled at anything but 1.0 s per group answers as plain vLLM does on the file; the same request
with the grid alone (what the proxy sent before) answers differently, so the test can fail.

A video's sampling per request (issue 33): a chat's ``media_io_kwargs: {"video": {"fps": F}}``
(vLLM's loader's rate) through the proxy answers as plain vLLM given the same kwargs, and
encode-server's ``/v1/tokens`` under ``{"fps": F}`` counts vLLM's placeholder. encode-server, the
proxy and plain vLLM are started with ``--trust-request-mm-kwargs`` (the defaults are unchanged by
it); the tower-free consumer is not: the proxy sends it neither field.

encode-server and the oracle are conftest's ``family_stack`` for Qwen2.5-VL (with a video
processor), shared with ``test_proxy_families.py``: its EC consumer keeps its tower, so a chat sent
to it straight, with its file and no ``uuid``, is named by vLLM's own hash, which the store never
holds, and vLLM runs its own loader and tower on the file. The tower-free consumer is this module's
own, on the stack's encode-server and Redis prefix.
"""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from encode_client import mm_hash
from encode_client.proxy import EPDProxy

from encode_server.core.settings import digest
from tests.server import ServerProcess
from tests.vllm.conftest import REDIS_URL, metric, on_family_stacks, running_proxy
from tests.vllm.epd_stack import (
    FamilyStack,
    Relay,
    answer_text,
    chat,
    post_chat,
    video_files,
    video_url_part,
    vllm_openai_server,
)

# (frames, fps, width, height): 2.5 s at 2 fps (4 of 5 frames sampled: 1.25 s per group) and 3.5 s at
# 6 fps (6 of 21: 1.17 s per group, not a float32 number); 56x56 frames are not resized.
CLIPS = [(5, 2.0, 56, 56), (21, 6.0, 56, 56)]
# The tiny model's chat template has no video branch: vLLM puts each item's placeholder before the
# text itself (the model's "<|vision_start|><|video_pad|><|vision_end|>"). The stack's consumer has
# it too (the family's ``ProxyCase``).
STRING_CONTENT = ("--chat-template-content-format", "string")
pytestmark = [pytest.mark.timeout(600), on_family_stacks("qwen2_vl")]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("proxy_qwen25_videos")
    return video_files(tmp, CLIPS)


@pytest.fixture(scope="module")
def server(family_stack: FamilyStack) -> ServerProcess:
    return family_stack.server


@pytest.fixture(scope="module")
def tower_free(family_stack: FamilyStack, logs: Path) -> Iterator[dict[str, Any]]:
    """The tower-free EC consumer of the stack's encode-server and prefix."""
    extra = {"redis_url": REDIS_URL, "encoder_url": family_stack.server.url, "prefix": family_stack.prefix}
    with vllm_openai_server(family_stack.model, extra, logs, STRING_CONTENT) as running:
        yield running


@pytest.fixture(scope="module")
def vllms(tower_free: dict[str, Any], family_stack: FamilyStack) -> list[dict[str, Any]]:
    """The tower-free EC consumer, and the oracle: the stack's consumer, which keeps its tower."""
    return [tower_free, family_stack.consumer]


@pytest.fixture(scope="module")
def relay(tower_free: dict[str, Any]) -> Iterator[Relay]:
    with Relay(tower_free["port"]) as r:
        yield r


@pytest.fixture(scope="module")
def proxy(relay: Relay, server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [server.url], trust_request_mm_kwargs=True) as p:
        yield p


def _sent_video_part(sent: bytes) -> dict[str, Any]:
    """The video part of the one chat request the relay saw."""
    body = json.loads(sent[sent.index(b"\r\n\r\n") + 4:])
    return next(p for p in body["messages"][0]["content"] if p["type"] == "video_embeds")


def test_a_clip_not_at_one_second_per_group_answers_through_the_proxy_as_plain_vllm(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, vllms: list[dict[str, Any]], clips: list[bytes]
) -> None:
    consumer, plain = vllms
    for clip, spec in zip(clips, CLIPS, strict=True):
        mark = relay.mark()
        through_proxy = answer_text(post_chat(proxy.url, chat([], video_url_part(clip))))
        sent = relay.since(mark)
        assert base64.b64encode(clip)[:64] not in sent, "frame bytes reached vLLM"
        part = _sent_video_part(sent)
        assert part["uuid"] == f"video:{mm_hash(clip)}"
        assert set(part["video_embeds"]) == {"video_grid_thw", "second_per_grid_ts"}
        seconds = np.load(io.BytesIO(base64.b64decode(part["video_embeds"]["second_per_grid_ts"])))
        meta = httpx.post(server.url + "/v1/tokens", timeout=30, json={
            "items": [{"data": base64.b64encode(clip).decode(), "modality": "video"}]}).json()["items"][0]["meta"]
        assert seconds.dtype == np.float32 and seconds == np.float32(meta["second_per_grid_ts"]) != 1.0, (spec, meta)

        on_the_file = answer_text(post_chat(plain["url"], chat([], video_url_part(clip))))
        # What the proxy sent before: the grid alone (vLLM assumes 1.0 s per group), to the same consumer.
        grid_only = {"type": "video_embeds", "video_embeds": {"video_grid_thw": part["video_embeds"]["video_grid_thw"]},
                     "uuid": part["uuid"]}
        before = answer_text(post_chat(consumer["url"], chat([], grid_only)))
        print(f"\nclip {spec} (second_per_grid_ts {meta['second_per_grid_ts']:.4g}): through the proxy "
              f"{through_proxy!r}, plain vLLM {on_the_file!r}, grid alone {before!r}")
        assert through_proxy == on_the_file, spec
        assert before != on_the_file, f"{spec}: the grid alone answers as plain vLLM too: this test cannot fail"


def test_a_client_cannot_set_the_seconds(proxy: EPDProxy, relay: Relay, clips: list[bytes]) -> None:
    """second_per_grid_ts comes from encode-server's meta only: a client's in its video part is
    dropped, and a client's video_embeds part carrying one is refused before vLLM sees it."""
    clip = clips[0]
    mark = relay.mark()
    own = video_url_part(clip)
    own["video_url"]["second_per_grid_ts"] = 9.0
    assert post_chat(proxy.url, chat([], own)).status_code == 200
    seconds = _sent_video_part(relay.since(mark))["video_embeds"]["second_per_grid_ts"]
    assert float(np.load(io.BytesIO(base64.b64decode(seconds)))) == 1.25
    mark = relay.mark()
    forged = {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4], "second_per_grid_ts": seconds}}
    r = post_chat(proxy.url, chat([], forged))
    assert r.status_code == 400 and re.search("video_embeds parts from clients are refused", r.text), r.text
    assert relay.since(mark) == b""


def _chat(clip: bytes, fps: float | None) -> dict[str, Any]:
    return chat([], video_url_part(clip), **({"media_io_kwargs": {"video": {"fps": fps}}} if fps else {}))


def _answer(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """The chat's text and its prompt's length (vLLM's placeholder rows are in it)."""
    r = post_chat(url, body)
    return answer_text(r), int(r.json()["usage"]["prompt_tokens"])


def _counted(server: ServerProcess, clip: bytes, fps: float | None) -> dict[str, Any]:
    item = {"data": base64.b64encode(clip).decode(), "modality": "video",
            **({"mm_processor_kwargs": {"fps": fps}} if fps else {})}
    r = httpx.post(server.url + "/v1/tokens", json={"items": [item]}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json()["items"][0])


# The 21-frame clip at 6 fps (3.5 s): 6 frames (3 groups) at the default 2 fps; 4 at 1 fps (the
# loader's minimum of 4: 2 groups, 1.75 s each); 14 at 4 fps (7 groups, 0.875 s each).
@pytest.mark.parametrize(("fps", "groups"), [(1.0, 2), (4.0, 7)])
def test_a_videos_fps_through_the_proxy_answers_as_plain_vllm_given_the_same_media_io_kwargs(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, vllms: list[dict[str, Any]], clips: list[bytes],
    fps: float, groups: int,
) -> None:
    _, plain = vllms
    clip = clips[1]
    mark = relay.mark()
    through_proxy = _answer(proxy.url, _chat(clip, fps))
    sent = relay.since(mark)
    assert b"media_io_kwargs" not in sent and b"mm_processor_kwargs" not in sent  # vLLM loads no video
    part = _sent_video_part(sent)
    assert part["uuid"] == f"p:{digest({'fps': fps})}:video:{mm_hash(clip)}"  # the bytes and the rate
    assert part["video_embeds"]["video_grid_thw"][0] == groups
    on_the_file = _answer(plain["url"], _chat(clip, fps))
    default = _answer(plain["url"], _chat(clip, None))
    counted, counted_default = _counted(server, clip, fps), _counted(server, clip, None)
    print(f"\nfps {fps}: through the proxy {through_proxy}, plain vLLM {on_the_file}, plain vLLM at 2 fps {default}; "
          f"encode-server counts {counted['num_tokens']} rows ({counted_default['num_tokens']} at 2 fps)")
    assert through_proxy == on_the_file
    assert counted["meta"]["video_grid_thw"] == part["video_embeds"]["video_grid_thw"]
    # vLLM's placeholder under the kwargs, from its prompt lengths: the same text, other rows.
    assert counted["num_tokens"] - counted_default["num_tokens"] == on_the_file[1] - default[1] != 0


def test_a_video_setting_the_family_refuses_is_a_400_naming_the_key_and_nothing_moves(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, clips: list[bytes]
) -> None:
    encoded = metric(httpx.get(server.url + "/metrics", timeout=10).text, "encode_server_items_total")
    mark = relay.mark()
    for kwargs, param in (({"video": {"fps": 0}}, "media_io_kwargs.video.fps"),
                          ({"video": {"num_frames": 8}}, "media_io_kwargs.video.num_frames"),
                          ({"image": {"image_mode": "L"}}, "media_io_kwargs.image")):
        r = post_chat(proxy.url, chat([], video_url_part(clips[0]), media_io_kwargs=kwargs))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post_chat(proxy.url, chat([], video_url_part(clips[0]), mm_processor_kwargs={"fps": 1.0}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "mm_processor_kwargs.fps", r.text
    assert "media_io_kwargs.video" in r.json()["error"]["message"]
    assert relay.since(mark) == b""
    assert metric(httpx.get(server.url + "/metrics", timeout=10).text, "encode_server_items_total") == encoded
