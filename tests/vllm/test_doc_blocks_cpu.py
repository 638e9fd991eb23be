"""docs/vllm.md's "On a CPU host" blocks run as written, each in a shell at the repository's root:
``make checkpoint``, encode-server, vLLM's OpenAI server from ``make vllm-env``'s environment with
the documented flags and variables, ``encode-epd-proxy``, and the ``curl`` of a chat with an image,
which gets a chat answer. Only the addresses change: the documented ports (8000, 8100, 8080), the
checkpoint's directory and the Redis URL become this run's own (a free port each, a temporary
directory, a ``redis-server`` of the test's), so that the run shares nothing with the machine.
``tests/integration/test_doc_blocks.py`` skips these four blocks, naming this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.docs.markdown import ROOT, code_blocks
from tests.redis_procs import start_redis
from tests.server import end_group, free_port
from tests.vllm.conftest import png

HEADING = "On a CPU host"
DOC_REDIS = "redis://127.0.0.1:6379/0"
DOC_CHECKPOINT = "/tmp/tiny-qwen"


def cpu_blocks() -> list[str]:
    blocks = [b.body for b in code_blocks((ROOT / "docs" / "vllm.md").read_text()) if b.heading == HEADING]
    assert len(blocks) == 4, blocks  # encode-server, vLLM, the proxy, the curl
    return blocks


def _user_shell() -> dict[str, str]:
    """A reader's environment: none of the test run's PYTHONPATH or vLLM variables."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("VLLM_")}


@contextmanager
def _running(command: str, cwd: Path, log: Path, ready_url: str, timeout: float) -> Iterator[None]:
    """``command`` by bash in a session of its own until ``ready_url`` answers 200; its whole
    process group ended after."""
    with log.open("ab") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_user_shell(), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"exited with {proc.returncode}: {command}\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready after {timeout} s: {command}\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield
    finally:
        end_group(proc)


@pytest.mark.timeout(600)
def test_the_cpu_host_blocks_answer_a_chat_with_an_image(tmp_path: Path) -> None:
    server_block, vllm_block, proxy_block, curl_block = cpu_blocks()
    ports = {"8000": free_port(), "8100": free_port(), "8080": free_port()}
    checkpoint = tmp_path / "tiny-qwen"

    with start_redis() as redis_server, ExitStack() as running:
        def local(block: str) -> str:
            block = block.replace(DOC_REDIS, redis_server.url).replace(DOC_CHECKPOINT, str(checkpoint))
            for documented, port in ports.items():
                block = block.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{port}")
                block = block.replace(f"--port {documented}", f"--port {port}")
            return block

        make_checkpoint, serve = local(server_block).splitlines()
        subprocess.run(["bash", "-c", make_checkpoint], cwd=ROOT, env=_user_shell(), check=True, timeout=300)
        assert (checkpoint / "config.json").exists()
        running.enter_context(_running(serve, ROOT, tmp_path / "encode-server.log",
                                       f"http://127.0.0.1:{ports['8000']}/ready", 120))
        running.enter_context(_running(local(vllm_block), ROOT, tmp_path / "vllm.log",
                                       f"http://127.0.0.1:{ports['8100']}/health", 300))
        running.enter_context(_running(local(proxy_block), ROOT, tmp_path / "proxy.log",
                                       f"http://127.0.0.1:{ports['8080']}/health", 60))
        (tmp_path / "cat.png").write_bytes(png(56, 56, seed=3))
        answer = subprocess.run(["bash", "-c", local(curl_block)], cwd=tmp_path, env=_user_shell(),
                                capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0, answer.stderr
        chat = json.loads(answer.stdout)
        assert chat["choices"][0]["message"]["content"].strip(), chat
        assert chat["usage"]["prompt_tokens"] > 4, chat  # the image's placeholder rows were in the prompt
