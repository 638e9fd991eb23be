"""Videos through the EPD proxy, proven by vLLM's OpenAI server: client -> encode-epd-proxy -> an EC
consumer (``EncodeServerECConnector``) serving a tiny Qwen3-VL, with encode-server and Redis beside
them, a recording relay in front of vLLM.

The proxy hands the image and the video off and sends vLLM ``image_embeds`` and ``video_embeds``
parts (the grid, the video's ``timestamps``, the identifier); the relay shows that no pixel or frame
byte arrives, so vLLM cannot have run its tower on them: the connector supplied both embeddings.
Plain vLLM with its tower (the consumer itself, sent the pixels and the video with no ``uuid``)
answers the chat on them (its own loader: OpenCV's FFmpeg, 2 fps): the answers are equal. The
videos are made with PyAV by the server's Python (``ENCODE_SERVER_PYTHON``).

The stack is conftest's ``family_stack`` for Qwen3-VL, shared with ``test_proxy_families.py`` and
``test_proxy_settings.py``. A video's rate per request (issue 33): encode-server, the consumer and
the stack's ``trusted_proxy`` take per-request settings (``--trust-request-mm-kwargs``; the
defaults are unchanged by it), so a chat's
``media_io_kwargs: {"video": {"fps": F}}`` through the proxy is checked, the video handed off under
it, and the answer and prompt length are plain vLLM's given the same kwargs on the file.

The consumer keeps its tower: vLLM 0.32 cannot take Qwen3-VL's DeepStack-wide embeddings tower-free
(``Qwen3VLForConditionalGeneration.use_deepstack`` is False when the tower is a ``StageMissingLayer``,
and merging the wide rows then fails, ``shape mismatch: value tensor of shape [12, 192] cannot be
broadcast to indexing result of shape [12, 64]``, killing the engine: measured with
``--limit-mm-per-prompt '{"image":0,"video":0}'``).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from encode_client import mm_hash
from encode_client.proxy import EPDProxy

from tests.server import ServerProcess, start_server
from tests.vllm.conftest import REDIS_URL, metric, on_family_stacks, png, running_proxy
from tests.vllm.epd_stack import (
    FamilyStack,
    Relay,
    answer_text,
    chat,
    chat_text,
    post_chat,
    video_files,
    video_url_part,
)

IMAGE = png(64, 64, seed=60)  # a multiple of 32 within the processor's pixel limits: not resized
# (frames, fps, width, height): 3 s at 2 fps, 6 frames in 3 groups; 3.5 s, 7 frames padded to 8 (4
# groups). 64x64 frames are not resized, so vLLM's own path and encode-server's agree exactly.
# One fresh video per retry case: vLLM's encoder cache keeps a video under its uuid once encoded.
# None is one of the stack's own clips (4 and 5 frames at 2 fps), which test_proxy_families sends
# the same servers, the second with zeros under its key.
CLIP = (6, 2.0, 64, 64)
LOST_CLIPS = {False: (7, 2.0, 64, 64), True: (8, 2.0, 64, 64)}
# 3.5 s at 6 fps: 7 frames (4 groups) at the default 2 fps, 4 (2 groups) at 1 fps, 14 (7) at 4 fps.
RATED = (21, 6.0, 64, 64)
# The first test may start the stack's vLLM server (20-140 s on the 2-core CI machine, by its load).
pytestmark = [pytest.mark.timeout(600), on_family_stacks("qwen3_vl")]


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("proxy_videos")
    clip, rated, *lost = video_files(tmp, [CLIP, RATED, *LOST_CLIPS.values()])
    return {"clip": clip, "rated": rated, **{f"lost-{k}": data for k, data in zip(LOST_CLIPS, lost, strict=True)}}


@pytest.fixture
def server(family_stack: FamilyStack) -> ServerProcess:
    return family_stack.server


@pytest.fixture
def consumer(family_stack: FamilyStack) -> dict[str, Any]:
    """The EC consumer (with its tower, see the module docstring), taking two images and a video per
    prompt. It is also plain vLLM, the oracle: a chat sent to it straight, with its pixels and its
    video and no ``uuid``, is named by vLLM's own hashes, which the store never holds, so vLLM
    loads and encodes them itself (as ``test_proxy_families.py`` and ``test_image_families.py``)."""
    return family_stack.consumer


@pytest.fixture
def plain(consumer: dict[str, Any]) -> dict[str, Any]:
    return consumer


@pytest.fixture
def relay(family_stack: FamilyStack) -> Relay:
    return family_stack.relay


@pytest.fixture
def proxy(family_stack: FamilyStack) -> EPDProxy:
    return family_stack.trusted_proxy


def _chat(video: bytes, **extra: Any) -> dict[str, Any]:
    """One image, one video, then the text."""
    return chat([IMAGE], video_url_part(video), **extra)


def _encoded_and_hits(server: ServerProcess) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return (metric(text, "encode_server_items_total", status="encoded"),
            metric(text, "encode_server_items_total", status="hit"))


def test_a_chat_with_an_image_and_a_video_sends_vllm_no_pixels_and_answers_as_plain_vllm(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, plain: dict[str, Any], videos: dict[str, bytes],
) -> None:
    video = videos["clip"]
    encoded, hits, mark = *_encoded_and_hits(server), relay.mark()
    started = time.perf_counter()
    first = answer_text(post_chat(proxy.url, _chat(video)))
    first_ms = (time.perf_counter() - started) * 1000

    sent = relay.since(mark)
    for data in (IMAGE, video):
        payload = base64.b64encode(data)
        assert payload[:64] not in sent and payload[-64:] not in sent, "pixel or frame bytes reached vLLM"
    assert b"image_url" not in sent and b"video_url" not in sent
    assert b'"video_embeds"' in sent and b'"video_grid_thw"' in sent and b'"timestamps"' in sent
    assert relay.uuids_since(mark) == [mm_hash(IMAGE), f"video:{mm_hash(video)}"]
    assert _encoded_and_hits(server) == (encoded + 2, hits)

    proxy_metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert metric(proxy_metrics, "encode_epd_proxy_handoff_videos_total") >= 1

    started = time.perf_counter()
    again = answer_text(post_chat(proxy.url, _chat(video)))  # the repeat: both from encode-server's cache
    again_ms = (time.perf_counter() - started) * 1000
    assert again == first
    assert _encoded_and_hits(server) == (encoded + 2, hits + 2)

    # The same chat with its pixels and its video: plain vLLM loads and encodes them itself.
    started = time.perf_counter()
    assert answer_text(post_chat(plain["url"], _chat(video))) == first
    plain_ms = (time.perf_counter() - started) * 1000
    print(f"\nchat with an image and a {CLIP[0] / CLIP[1]:.0f} s video: via the proxy {first_ms:.0f} ms (encoded), "
          f"{again_ms:.0f} ms (cached); plain vLLM on the pixels and the video {plain_ms:.0f} ms")


@pytest.mark.parametrize(("fps", "groups"), [(1.0, 2), (4.0, 7)])
def test_a_videos_fps_through_the_proxy_answers_as_plain_vllm_given_the_same_media_io_kwargs(
    proxy: EPDProxy, relay: Relay, server: ServerProcess, plain: dict[str, Any], videos: dict[str, bytes],
    fps: float, groups: int,
) -> None:
    """Qwen3-VL's loader samples at the request's rate, and each group's timestamp text sits in the
    placeholder: equal prompt lengths mean the times the proxy sent are vLLM's too."""
    from encode_server.core.settings import digest

    video = videos["rated"]
    body = chat([], video_url_part(video), media_io_kwargs={"video": {"fps": fps}})
    mark = relay.mark()
    r = post_chat(proxy.url, body)
    through_proxy = answer_text(r), r.json()["usage"]["prompt_tokens"]
    sent = relay.since(mark)
    assert b"media_io_kwargs" not in sent and b"video_url" not in sent
    assert relay.uuids_since(mark) == [f"p:{digest({'fps': fps})}:video:{mm_hash(video)}"]
    r = post_chat(plain["url"], body)
    on_the_file = answer_text(r), r.json()["usage"]["prompt_tokens"]
    r = post_chat(plain["url"], chat([], video_url_part(video)))
    default = answer_text(r), r.json()["usage"]["prompt_tokens"]
    item = {"data": base64.b64encode(video).decode(), "modality": "video", "mm_processor_kwargs": {"fps": fps}}
    meta = httpx.post(server.url + "/v1/tokens", json={"items": [item]}, timeout=30).json()["items"][0]["meta"]
    print(f"\nqwen3_vl fps {fps}: through the proxy {through_proxy}, plain vLLM {on_the_file}, at 2 fps {default}; "
          f"encode-server's grid {meta['video_grid_thw']}, times {meta['timestamps']}")
    assert through_proxy == on_the_file
    assert meta["video_grid_thw"][0] == groups and on_the_file[1] != default[1]


def test_video_parts_the_proxy_refuses_are_400s_naming_the_part_and_reach_no_one(
    proxy: EPDProxy, relay: Relay, videos: dict[str, bytes]
) -> None:
    video = videos["clip"]
    truncated = video[: len(video) // 3]
    cases = {
        "encode-server refused this video": video_url_part(truncated),
        "only data: URLs": {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}},
        "a client's uuid is refused": {**video_url_part(video), "uuid": mm_hash(video)},
        "video_embeds parts from clients are refused": {
            "type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4], "timestamps": [0.5, 1.5]},
            "uuid": mm_hash(video)},
    }
    mark = relay.mark()
    for words, part in cases.items():
        r = post_chat(proxy.url, chat([IMAGE], part))
        assert r.status_code == 400, (words, r.text)
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "messages[0].content[1]"), error
        assert words in error["message"], error
    assert relay.since(mark) == b"", "a refused request reached vLLM"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_video_lost_between_hand_off_and_prefill_is_handed_off_again_and_retried(
    family_stack: FamilyStack, logs: Path, consumer: dict[str, Any], plain: dict[str, Any], videos: dict[str, bytes],
    stream: bool,
) -> None:
    """Redis loses the video's value as the request goes to vLLM (a relay deletes it) and no E holds
    it (this proxy's encode-server has no local tier; the connector's fallback asks the module's,
    which never saw it): vLLM fails the request, the proxy hands the image and the video off again
    (the video re-encoded) and retries, and the answer is plain vLLM's on the pixels and the video."""

    video = videos[f"lost-{stream}"]
    store = redis.Redis.from_url(REDIS_URL)
    lost: list[str] = []

    def evict_once(chunk: bytes) -> None:
        if not lost and b'"uuid"' in chunk:
            keys = list(store.scan_iter(f"{family_stack.prefix}:*{mm_hash(video)}"))
            lost.extend(k.decode() for k in keys)
            store.delete(*keys)

    lone = start_server("--model", str(family_stack.model), "--redis-url", REDIS_URL,
                        "--cache-prefix", family_stack.prefix, "--grpc-port", "0", "--dtype", "float32",
                        "--cache-mb", "0", log_dir=logs)
    evicting = Relay(consumer["port"], before_forward=evict_once)
    evicting.start()
    try:
        with running_proxy(evicting.url, [lone.url]) as proxy:
            text = chat_text(proxy.url, _chat(video, stream=stream), stream=stream)
            proxy_metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        assert lost, "the relay evicted the video's value"
        assert metric(proxy_metrics, "encode_epd_proxy_retries_total", reason="prefill_error") == 1
        assert metric(proxy_metrics, "encode_epd_proxy_handoff_videos_total") == 2  # handed off, then again
        assert evicting.since(0).count(b"POST /v1/chat/completions") == 2
        assert text == answer_text(post_chat(plain["url"], _chat(video)))
    finally:
        evicting.close()
        lone.stop()
