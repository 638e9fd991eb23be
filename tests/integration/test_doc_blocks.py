"""Every shell and Python block of README.md and docs/*.md, run as a reader runs it, against live servers.

The reader's setup: two built-in-model servers (``A`` with the shared Redis tier under its own key
prefix, ``B`` without), a working folder holding the files the blocks name (``cat.png``, a
realistic photo-sized image: a noisy 640x480 PNG of some 900 KB, whose base64 is far past the
kernel's 128 KiB limit on one command-line argument, so a block that puts it on a command line
fails here as it would for a reader; ``dog.jpg``, a few more PNGs, ``./images/``), the venv's
``bin`` first on ``PATH`` (``python``, ``encode-server``, ``encode-client``; ``b3sum`` and
``curl`` from the system) and
``ENCODE_CLIENT_URL`` naming ``A``, as the CLI's help says to. Blocks about videos name the host
``qwen3-vl``: a third server, a tiny Qwen3-VL, started for the first such block only, with
``clip.mp4``, ``clip.ts`` and ``./videos/`` in the folder. Each block runs alone, in a fresh
``bash -e -o pipefail`` or ``python``, and must exit 0; curl is told to fail on an HTTP error
(``fail-with-body`` in a ``.curlrc``: the blocks' ``curl -s`` exits 0 on a 4xx).

The one change made to a block: the hosts and ports it names (``localhost:8000``,
``localhost:50051``, ``replica-a``/``replica-b``, ``a``/``b``, ``encoder``, ``redis:6379``) become
the live servers' and Redis's (``SUBSTITUTE``), since tests never take the fixed ports.

A block that needs what a test cannot have (a hub model, vLLM, docker, kubectl, long-running
servers on hosts named ``redis``) is in ``SKIP`` with its reason. The first test fails for a
block that is neither run nor skipped (an unknown language), and for a ``SKIP`` entry that names
no block, so a new or edited block cannot escape: by default it runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests import tiny_models
from tests.docs.markdown import ROOT, doc_files
from tests.images import image_bytes
from tests.server import ServerProcess, start_server
from tests.videos import make_video

RUN = ("bash", "python")
NOT_CODE = ("json", "promql", "text")  # sample output, queries, formulas, drawings

# (page, the block's first line) -> why it is not run here.
SKIP: dict[tuple[str, str], str] = {
    ("README.md", "make serve   # creates .venv, installs, serves the built-in model: HTTP on 0.0.0.0:8000, gRPC on "
     "0.0.0.0:50051"):
        "serves on the fixed port 8000 until stopped, and `make test` runs this very suite",
    ("README.md", ".venv/bin/encode-server --model Qwen/Qwen2.5-VL-7B-Instruct --host 0.0.0.0          # hub id"):
        "downloads multi-GB models from the Hugging Face hub; the families are tested on tiny "
        "checkpoints (tests/integration/test_families.py)",
    ("README.md", "encode-server --model /models/Qwen2.5-VL-7B-Instruct --redis-url redis://redis:6379/0"):
        "needs vLLM serving a real model and hosts named redis and prefill; tests/vllm runs this "
        "chain on a tiny model (make test-vllm)",
    ("docs/api.md", "grpcurl -plaintext -import-path encode_server/api/proto -proto encode_server/v1/encoder.proto \\"):
        "grpcurl is no Debian or npm package, and PyPI has only a third party's repackaged binary "
        "(see the page); the same calls run in the Python block above it",
    ("docs/models.md", ".venv/bin/encode-server --model Qwen/Qwen2.5-VL-7B-Instruct --host 0.0.0.0   # hub id"):
        "downloads multi-GB models from the Hugging Face hub",
    ("docs/operations.md", ".venv/bin/encode-server --redis-url redis://redis:6379/0                  # one Redis"):
        "three servers that run until stopped, on the fixed port 8000, against a TLS Redis and a "
        "Redis Cluster named redis; tests/integration/test_redis_cluster.py and test_redis_shared.py "
        "run these tiers",
    ("docs/operations.md", "docker build -t encode-server .                                   # GPU (CUDA 12.8)"):
        "docker, a GPU, Compose and kubectl; make test-container builds and runs the image with "
        "podman, tests/deploy validates the Compose and Kubernetes files",
    ("docs/operations.md", "podman build --format docker --network host -t encode-server:cpu \\"):
        "the image build of make test-container (tests/container), minutes long",
    ("docs/vllm.md", "encode-server --model /models/Qwen2.5-VL-7B-Instruct --redis-url redis://redis:6379/0"):
        "a server for a real model directory and a host named redis, run until stopped",
    ("docs/vllm.md", "vllm serve /models/Qwen2.5-VL-7B-Instruct --limit-mm-per-prompt '{\"image\":0,\"video\":0}' "
     "--ec-transfer-config '{"):
        "vLLM serving a real model; tests/vllm runs it on a tiny one (make test-vllm)",
    ("docs/epd-families.md", "encode-server --model /models/Qwen2-Audio-7B-Instruct --redis-url redis://redis:6379/0 "
     "--host 0.0.0.0"):
        "a Qwen2-Audio stack on a real model directory and named hosts, run until stopped; tests/vllm/"
        "test_proxy_audio.py runs it on a tiny one",
    ("docs/epd-families.md", "encode-server --model /models/Qwen2.5-Omni-7B --redis-url redis://redis:6379/0 --host "
     "0.0.0.0"):
        "a Qwen2.5-Omni stack on a real model directory and named hosts, run until stopped; tests/vllm/"
        "test_qwen2_5_omni.py and test_proxy_families.py run it on a tiny one",
    ("docs/epd-families.md", "vllm serve /models/Qwen2.5-Omni-7B --trust-request-mm-kwargs \\"):
        "a prefill and a proxy taking use_audio_in_video on a real model directory and named hosts, run until "
        "stopped; tests/vllm/test_proxy_families.py runs both Omni thinkers so on tiny ones",
    ("docs/epd-families.md", "encode-server --model /models/Qwen3-Omni-30B-A3B-Instruct --redis-url "
     "redis://redis:6379/0 --host 0.0.0.0"):
        "a Qwen3-Omni stack on a real model directory and named hosts, run until stopped; tests/vllm/"
        "test_qwen3_omni.py and test_proxy_families.py run it on a tiny one",
    ("README.md", "make demo-epd   # the whole EPD stack on this CPU machine; prints the proxy's URL and a chat to "
     "send it"):
        "needs vLLM's environment and runs until Ctrl-C; tests/vllm/test_demo_epd.py runs it (the target's module) "
        "and its printed curl and snippet",
    ("docs/vllm.md", "encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill:8000 --encoder "
     "http://encode-server:8000"):
        "a proxy in front of step 1's and 2's hosts (prefill, encode-server), run until stopped",
    ("docs/vllm.md", "make checkpoint DIR=/tmp/tiny-qwen"):
        "the CPU-host stack, whose vLLM needs vLLM's environment: tests/vllm/test_doc_blocks_cpu.py runs its "
        "four blocks as written",
    ("docs/vllm.md", "VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_WAIT_POLICY=PASSIVE "
     "PYTHONPATH=$PWD/clients/python \\"):
        "vLLM's OpenAI server from make vllm-env's environment: tests/vllm/test_doc_blocks_cpu.py runs it",
    ("docs/vllm.md", ".venv/bin/encode-epd-proxy --listen 127.0.0.1:8080 --vllm http://127.0.0.1:8100 --encoder "
     "http://127.0.0.1:8000"):
        "the CPU-host stack's proxy, in front of its vLLM: tests/vllm/test_doc_blocks_cpu.py runs it",
    ("docs/vllm.md", "{ printf '{\"model\": \"tiny\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", "
     "\"content\": ['"):
        "a chat through the CPU-host stack's proxy: tests/vllm/test_doc_blocks_cpu.py sends it",
    ("docs/sglang.md", "pip install '.[sglang]'                 # in the clone: pyzmq (make install's .venv has it "
     "already)"):
        "a server for a hub model and a host named redis, run until stopped; tests/integration/test_sglang_door.py "
        "runs --sglang on the built-in model",
    ("docs/sglang.md", "python -m sglang.launch_server --model-path Qwen/Qwen2.5-VL-7B-Instruct --port 30000 \\"):
        "a whole SGLang prefill needs CUDA; tests/sglang runs SGLang's own receiving code against real servers",
    ("docs/epd-proxy.md",
     "encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill-a:8000 --vllm http://prefill-b:8000 \\"):
        "proxies in front of vLLMs and encode-servers on named hosts, run until stopped; tests/vllm runs the "
        "proxy against a real vLLM",
}

# Linux's limit on one argument of a program (a page x 32): a longer one is "Argument list too long".
MAX_ARG_STRLEN = 128 * 1024

_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    code: str

    @property
    def first_line(self) -> str:
        return next(line for line in self.code.splitlines() if line.strip())

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for doc in doc_files():
        text = doc.read_text()
        page = doc.relative_to(ROOT).as_posix()
        for m in _FENCE.finditer(text):
            out.append(Block(page, text[: m.start()].count("\n") + 1, m.group(1), m.group(2)))
    return out


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b.language in RUN and (b.page, b.first_line) not in SKIP]


def test_every_block_is_run_or_skipped_for_a_stated_reason() -> None:
    assert len(BLOCKS) > 40, "the fence parser found too few blocks"
    unknown = [f"{b} ({b.language or 'no language'})" for b in BLOCKS if b.language not in RUN + NOT_CODE]
    assert unknown == [], f"give each block a language, one of {RUN + NOT_CODE}: {unknown}"
    for key, reason in SKIP.items():
        matching = [b for b in BLOCKS if (b.page, b.first_line) == key and b.language in RUN]
        assert len(matching) == 1, f"SKIP entry {key} matches {len(matching)} blocks: update or remove it"
        assert len(reason) > 20, key
    assert len(RUNNABLE) >= 20, [str(b) for b in RUNNABLE]


def test_no_block_puts_a_files_base64_on_a_command_line() -> None:
    """The blocks that run do so with a photo-sized ``cat.png`` (see the module doc); this covers
    the skipped ones too (grpcurl): a ``$(base64 FILE)`` is only ever an argument of ``printf``,
    the shell's own, whose output is piped to the program (``-d @-``, ``-d @``)."""
    outside_printf = [
        f"{b}: {line.strip()}"
        for b in BLOCKS if b.language == "bash"
        for line in b.code.splitlines()
        if "$(base64" in line and not line.lstrip().startswith("printf ")
    ]
    assert outside_printf == [], outside_printf


@dataclass
class Reader:
    """What a reader has: a folder, an environment, and the address each name in the docs means."""

    folder: Path
    env: dict[str, str]
    substitute: dict[str, str]
    video_server: Callable[[], ServerProcess]  # started on first call: only video blocks pay for it

    def prepare(self, code: str) -> str:
        if VIDEO_HOST in code:
            video = self.video_server()
            code = code.replace(f"http://{VIDEO_HOST}:8000", video.url)
            code = code.replace(f"grpc://{VIDEO_HOST}:50051", "grpc://" + video.grpc_target)
        for name, real in self.substitute.items():
            code = code.replace(name, real)
        return code


VIDEO_HOST = "qwen3-vl"


@pytest.fixture(scope="module")
def reader(server_logs: Path, shared_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    prefix = f"docs-blocks-{uuid.uuid4().hex[:8]}"
    a = start_server("--redis-url", shared_redis_url, "--cache-prefix", prefix, log_dir=server_logs)
    b: ServerProcess | None = None
    video: list[ServerProcess] = []

    def video_server() -> ServerProcess:
        if not video:
            model = tiny_models.make_qwen3(tmp_path_factory.mktemp("qwen3_vl"))
            video.append(start_server("--model", str(model), log_dir=server_logs))
        return video[0]
    try:
        b = start_server(log_dir=server_logs)
        folder = tmp_path_factory.mktemp("reader")
        cat = image_bytes("PNG", 640, 480, seed=2400)
        assert len(cat) * 4 // 3 > 4 * MAX_ARG_STRLEN, "cat.png is no longer a realistic size"
        (folder / "cat.png").write_bytes(cat)
        (folder / "dog.jpg").write_bytes(image_bytes("JPEG", 120, 90, seed=2401))
        (folder / "bird.png").write_bytes(image_bytes("PNG", 64, 48, seed=2402))
        (folder / "images" / "more").mkdir(parents=True)
        for i in range(3):
            path = folder / "images" / ("more" if i else "") / f"{i}.png"
            path.write_bytes(image_bytes("PNG", 56, 56, seed=2410 + i))
        (folder / "clip.mp4").write_bytes(make_video(10, 4.0, 64, 48, seed=2420))
        (folder / "clip.ts").write_bytes(make_video(8, 4.0, 48, 64, seed=2421, container_format="mpegts"))
        (folder / "videos").mkdir()
        (folder / "videos" / "a.webm").write_bytes(make_video(6, 3.0, 64, 64, codec="libvpx-vp9", seed=2422))
        (folder / "videos" / "b.mp4").write_bytes(make_video(8, 4.0, 32, 32, seed=2423))
        curl_home = tmp_path_factory.mktemp("curl")
        (curl_home / ".curlrc").write_text("fail-with-body\nshow-error\n")
        bin_dir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENCODE_CLIENT_", "ENCODE_SERVER_"))}
        env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", CURL_HOME=str(curl_home),
                   ENCODE_CLIENT_URL=a.url, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        a_host = a.url.removeprefix("http://")
        substitute = {
            "localhost:8000": a_host, "localhost:50051": a.grpc_target,
            "http://replica-a:8000": a.url, "http://replica-b:8000": b.url,
            "http://a:8000": a.url, "http://b:8000": b.url, "http://encoder:8000": a.url,
            "redis://redis:6379/0": shared_redis_url,
        }
        yield Reader(folder, env, substitute, video_server)
    finally:
        for server in (a, b, *video):
            if server is not None:
                assert server.stop() == 0, server.log()
        client = redis.Redis.from_url(shared_redis_url)
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_the_block_runs_as_written(block: Block, reader: Reader) -> None:
    code = reader.prepare(block.code)
    if block.language == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        script = reader.folder / f"block_{block.line}.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=reader.folder, env=reader.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{block} exited {done.returncode}:\n{code}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
