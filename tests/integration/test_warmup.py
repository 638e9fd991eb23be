"""The warm-up runs the family's worst case before the server is ready (``--warmup worst``, the
default), publishes what it ran and the peak memory in ``GET /v1/model`` (and gRPC ``Model``), and
a server that cannot hold its own worst case does not start, saying why in one line.

Real server processes (tests/server.py starts the others with ``--warmup quick``); the limits are
lowered so that the worst case takes a second on the tiny models, not what the defaults admit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests import tiny_models
from tests.integration.test_startup_failures import problems
from tests.server import ServerProcess, run_server_to_exit, start_server

MAX_PIXELS = 1_000_000
LIMITS = ("--warmup", "worst", "--max-image-pixels", str(MAX_PIXELS), "--max-video-seconds", "6",
          "--max-batch-size", "4", "--max-inflight-mb", "300")


@pytest.fixture(scope="module")
def video_server(server_logs: Path) -> Iterator[ServerProcess]:
    """The built-in model (a tiny Qwen2.5-VL: images and videos)."""
    proc = start_server(*LIMITS, log_dir=server_logs)
    yield proc
    assert proc.stop() == 0, proc.log()


def _warmup(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/v1/model", timeout=30).json()["warmup"]


def test_the_worst_image_and_the_longest_video_ran_and_their_peak_is_published(video_server: ServerProcess) -> None:
    warmup = _warmup(video_server)
    assert warmup["mode"] == "worst" and warmup["seconds"] > 0
    image, video = warmup["cases"]
    assert image["modality"] == "image" and image["width"] * image["height"] <= MAX_PIXELS
    assert image["width"] * image["height"] > 0.99 * MAX_PIXELS  # the largest the limit allows
    # a full pass of it: as many as --max-batch-size takes within --max-batch-tokens (65536)
    assert image["items"] == min(4, 65536 // image["cost_tokens"]) and image["num_tokens"] > 0
    assert video["modality"] == "video" and video["seconds"] <= 6 and video["frames"] >= 6
    assert video["width"] * video["height"] <= MAX_PIXELS and video["num_tokens"] > image["num_tokens"]
    # the host's peak over the warm-up alone (VmHWM reset before it), above what the frames took
    assert warmup["peak_host_since_start"] is False
    assert warmup["peak_host_bytes"] > video["frames"] * video["width"] * video["height"] * 3
    assert warmup["peak_device_bytes"] is None  # no CUDA here
    with grpc.insecure_channel(video_server.grpc_target) as channel:
        model = pb_grpc.EncoderStub(channel).Model(pb.ModelRequest(), timeout=30)
    assert json.loads(model.json)["warmup"] == warmup
    line = [ln for ln in video_server.log().splitlines() if "warm-up (worst)" in ln]
    assert len(line) == 1 and "peak memory: host" in line[0] and "video of" in line[0], line


def test_an_image_only_family_warms_up_with_its_worst_image_alone(
    tmp_path_factory: pytest.TempPathFactory, server_logs: Path
) -> None:
    clip = tiny_models.make_clip(tmp_path_factory.mktemp("warmup_clip"))
    server = start_server("--model", str(clip), *LIMITS, log_dir=server_logs)
    try:
        (image,) = _warmup(server)["cases"]
        # CLIP resizes every image to one size: the same rows at any shape, so the square is taken
        assert image["modality"] == "image" and image["width"] == image["height"] == 1000
        assert image["items"] == 4  # a few rows each: the batch size bounds the pass
    finally:
        assert server.stop() == 0, server.log()


def test_a_family_with_audio_beside_images_warms_up_its_longest_audio_last(
    server_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Qwen2.5-Omni: the worst image, the longest video, then a full pass of its longest audio: it reads
    a whole file (no 30 s window), so ``--max-audio-seconds`` of it."""
    from tests.tiny.qwen2_5_omni import make_tiny_qwen2_5_omni

    omni = make_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni"))
    server = start_server("--model", str(omni), *LIMITS, "--max-audio-seconds", "40", log_dir=server_logs)
    try:
        cases = _warmup(server)["cases"]
    finally:
        assert server.stop() == 0, server.log()
    assert [case["modality"] for case in cases] == ["image", "video", "audio"], cases
    audio = cases[-1]
    assert audio["seconds"] == 40 and audio["num_tokens"] == 1000 and audio["items"] == 4


def test_the_quick_warm_up_runs_one_small_image(server_logs: Path) -> None:
    server = start_server("--warmup", "quick", log_dir=server_logs)
    try:
        warmup = _warmup(server)
        assert warmup["mode"] == "quick"
        assert [(c["width"], c["height"], c["items"]) for c in warmup["cases"]] == [(64, 64, 1)]
    finally:
        assert server.stop() == 0, server.log()


def test_a_server_that_cannot_hold_its_worst_case_does_not_start_and_says_so_in_one_line() -> None:
    """No request-memory budget (``--max-inflight-mb 0``): the longest video the limits admit is
    768 frames of 40 M pixels (86 GiB decoded), which an 8 GiB address space cannot hold."""
    # Without gRPC: once (make test, 2026-12-05) its event engine's poller aborted the process
    # (SIGABRT, "epoll_wait error: Bad file descriptor") during this starved warm-up, before the
    # warm-up's own line; what is under test here is that line and the exit code.
    code, output = run_server_to_exit("--warmup", "worst", "--max-inflight-mb", "0", "--grpc-port", "0",
                                      timeout=120, address_space=8 << 30)
    assert code == 1, output
    reported = problems(output)
    assert len(reported) == 1, output
    assert "the warm-up's worst case failed at the longest video" in reported[0], reported[0]
    assert "MemoryError" in reported[0] and "--max-image-pixels 40000000" in reported[0], reported[0]
    assert "Traceback" not in output and "running on" not in output[output.index("worst case failed"):]
