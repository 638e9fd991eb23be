"""The command blocks of README.md and docs/vllm.md run as written, or are listed here with the reason
they cannot run on this machine; and every install line names something this repository builds.

``VERDICTS`` names every ``bash`` and ``python`` block of the two pages by its page and first line:
a block the table does not name, or a name no block has, fails (a new block must be run or given
a reason). The blocks that run here run against one ``builtin:tiny`` encode-server with a Redis of
the test's own, in a directory holding the files they name (``cat.png``, ``dog.jpg``,
``./images``); only the addresses change (``localhost:8000``, ``redis://redis:6379/0``,
``http://encoder:8000`` become the test's), and ``curl -s`` becomes ``curl -sf`` so that an error
status fails the block. docs/vllm.md's CPU-host blocks need vLLM's environment and run in the vLLM
suite (``tests/vllm/test_doc_blocks_cpu.py``), as ``make demo-epd`` does (``test_demo_epd.py``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tomllib

from tests.docs.markdown import ROOT, CodeBlock, code_blocks, doc_files
from tests.images import image_bytes
from tests.redis_procs import start_redis
from tests.server import ServerProcess, free_port, start_server
from tests.tools import require_tool

PAGES = ("README.md", "docs/vllm.md")
RUN_HERE = "run here"
GPU_MODEL = "skipped: a real checkpoint (/models/...: gigabytes) on a GPU host, and its hosts (redis, prefill)"

# (page, the block's first line up to its first '#' comment, stripped) -> how it is run
VERDICTS: dict[tuple[str, str], str] = {
    ("README.md", "make serve"): "run by test_make_serve_serves_on_the_ports_it_is_given (its first line; the "
                                 "second, make test, is the suite this test is part of)",
    ("README.md", "# upload an image (raw body, multipart, or JSON with base64 all work)"): RUN_HERE,
    ("README.md", "curl -s localhost:8000/v1/tokens -H 'Content-Type: image/png' --data-binary @cat.png"): RUN_HERE,
    ("README.md", "from encode_client import Client"): RUN_HERE,
    ("README.md", "encode-client hash cat.png"): RUN_HERE,
    ("README.md", ".venv/bin/encode-server --model Qwen/Qwen2.5-VL-7B-Instruct --host 0.0.0.0"):
        "skipped: hub models (gigabytes downloaded)",
    ("README.md", "make demo-epd"): "run by tests/vllm/test_demo_epd.py (the target's module, scripts/demo_epd.py)",
    ("README.md", "encode-server --model /models/Qwen2.5-VL-7B-Instruct --redis-url redis://redis:6379/0"): GPU_MODEL,
    ("docs/vllm.md", "encode-server --model /models/Qwen2.5-VL-7B-Instruct --redis-url redis://redis:6379/0"):
        GPU_MODEL,
    ("docs/vllm.md", "vllm serve /models/Qwen2.5-VL-7B-Instruct --limit-mm-per-prompt '{\"image\":0,\"video\":0}' "
                     "--ec-transfer-config '{"): GPU_MODEL,
    ("docs/vllm.md", "encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill:8000 --encoder "
                     "http://encode-server:8000"): "skipped: the hosts of step 1 and 2 (prefill, encode-server)",
    ("docs/vllm.md", "make checkpoint DIR=/tmp/tiny-qwen"): "run by tests/vllm/test_doc_blocks_cpu.py",
    ("docs/vllm.md", "VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_WAIT_POLICY=PASSIVE "
                     "PYTHONPATH=$PWD/clients/python \\"): "run by tests/vllm/test_doc_blocks_cpu.py",
    ("docs/vllm.md", ".venv/bin/encode-epd-proxy --listen 127.0.0.1:8080 --vllm http://127.0.0.1:8100 --encoder "
                     "http://127.0.0.1:8000"): "run by tests/vllm/test_doc_blocks_cpu.py",
    ("docs/vllm.md", "curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' "
                     "-d '{\"model\": \"tiny\","): "run by tests/vllm/test_doc_blocks_cpu.py",
    ("docs/vllm.md", "encode-epd-proxy --listen 0.0.0.0:8080 --vllm http://prefill-a:8000 --vllm "
                     "http://prefill-b:8000 \\"): "skipped: four hosts, and its second line ends in '...'",
    ("docs/vllm.md", "encode-server --model /models/Qwen2-Audio-7B-Instruct --redis-url redis://redis:6379/0 "
                     "--host 0.0.0.0"): GPU_MODEL,
    ("docs/vllm.md", "encode-server --model /models/Qwen2.5-Omni-7B --redis-url redis://redis:6379/0 --host 0.0.0.0"):
        GPU_MODEL,
    ("docs/vllm.md", "encode-server --model /models/Qwen3-Omni-30B-A3B-Instruct --redis-url redis://redis:6379/0 "
                     "--host 0.0.0.0"): GPU_MODEL,
    ("docs/vllm.md", "vllm serve /models/Qwen2.5-Omni-7B --trust-request-mm-kwargs \\"):
        GPU_MODEL + "; its config is '...as above...'",
    ("docs/vllm.md", "import base64"): RUN_HERE,
}


def _key(block: CodeBlock) -> str:
    first = block.first_line
    return first if first.startswith("#") else first.split("  #")[0].strip()


def _blocks() -> dict[tuple[str, str], CodeBlock]:
    out = {}
    for page in PAGES:
        for block in code_blocks((ROOT / page).read_text()):
            if block.language in ("bash", "python"):
                key = (page, _key(block))
                assert key not in out, f"two blocks of {page} start alike: {key[1]!r}"
                out[key] = block
    return out


def test_every_command_block_is_run_or_skipped_with_a_reason() -> None:
    blocks = _blocks()
    assert sorted(set(blocks) - set(VERDICTS)) == [], "blocks with no verdict: run them here or give a reason"
    assert sorted(set(VERDICTS) - set(blocks)) == [], "verdicts for blocks that no longer exist"
    for verdict in VERDICTS.values():
        if verdict.startswith("run by tests/"):
            assert (ROOT / verdict.split()[2]).exists(), verdict


_PIP = re.compile(r"pip install ([^`\n]+)`")
_OWN = {"encode-client", "encode_client", "encode-server", "encode_server"}


def test_install_lines_name_the_clone_or_the_wheels_never_a_package_index() -> None:
    """``pip install`` of the project is from a clone's path or ``make dist``'s wheels, with extras
    its pyproject declares: the project is on no package index."""
    extras = {
        "./clients/python": set(tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]
                                ["optional-dependencies"]),
        ".": set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]),
    }
    extras["dist/encode_client-*.whl"] = extras["./clients/python"]
    extras["dist/encode_server-*.whl"] = extras["."]
    seen = 0
    for doc in doc_files():
        for line in _PIP.findall(doc.read_text()):
            for arg in line.split():
                target = arg.strip("'\"").replace('$(ls ', "").replace(")", "")
                name, _, extra = target.partition("[")
                if re.sub(r"[^\w-]", "", name.lower()) in _OWN or name.lower().startswith(tuple(_OWN)):
                    pytest.fail(f"{doc.name}: `pip install {line}` installs from a package index the project is not on")
                if name in extras:
                    seen += 1
                    wanted = {e for e in extra.rstrip("]").split(",") if e}
                    assert wanted <= extras[name], f"{doc.name}: `pip install {line}`: no extra {wanted - extras[name]}"
    assert seen >= 4


def test_make_dist_builds_both_wheels_and_the_documented_lines_install_them(tmp_path: Path) -> None:
    """``make dist``, then the README's and docs/vllm.md's install lines, from the wheels and from
    the clone (without dependencies: what is checked is that each resolves and builds)."""
    subprocess.run(["make", "-s", "dist"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    wheels = sorted(p.name.split("-")[0] for p in (ROOT / "dist").glob("*.whl"))
    assert wheels == ["encode_client", "encode_server"]
    pip = f"{sys.executable} -m pip install --quiet --no-deps --no-build-isolation --target {tmp_path}/t"
    for line in ('"$(ls dist/encode_client-*.whl)[vllm]"', "dist/encode_server-*.whl", "'./clients/python[vllm]'"):
        subprocess.run(["bash", "-c", f"{pip} --upgrade {line}"], cwd=ROOT, check=True, timeout=300)
    assert (tmp_path / "t" / "encode_client" / "vllm_connector.py").exists()
    assert (tmp_path / "t" / "encode_server" / "__main__.py").exists()


# -- the blocks that run here --


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str, Path]]:
    """builtin:tiny on a Redis of its own, and a directory with the files the blocks name."""
    files = tmp_path_factory.mktemp("doc-blocks")
    (files / "cat.png").write_bytes(image_bytes("PNG", 640, 480, seed=1))
    (files / "dog.jpg").write_bytes(image_bytes("JPEG", 320, 240, seed=2))
    (files / "images").mkdir()
    (files / "images" / "a.png").write_bytes(image_bytes("PNG", 64, 64, seed=3))
    with start_redis() as redis_server:
        server = start_server("--redis-url", redis_server.url, "--grpc-port", "0", log_dir=files)
        try:
            yield server, redis_server.url, files
        finally:
            server.stop()


def _local(text: str, server: ServerProcess, redis_url: str) -> str:
    port = server.url.rsplit(":", 1)[1]
    return (text.replace("localhost:8000", f"localhost:{port}").replace("http://encoder:8000", server.url)
            .replace("redis://redis:6379/0", redis_url).replace("curl -s ", "curl -sf "))


def _shell() -> dict[str, str]:
    """A reader's shell after ``source .venv/bin/activate``."""
    return {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}


@pytest.mark.parametrize("key", [k for k, v in VERDICTS.items() if v == RUN_HERE],
                         ids=lambda k: f"{k[0]}:{k[1][:40]}")
def test_the_block_runs_as_written(key: tuple[str, str], served: tuple[ServerProcess, str, Path]) -> None:
    server, redis_url, files = served
    block = _blocks()[key]
    if "b3sum" in block.body:
        require_tool("b3sum")
    body = _local(block.body, server, redis_url)
    shell = ["bash", "-c", "set -euo pipefail\n" + body]
    cmd = [sys.executable, "-c", body] if block.language == "python" else shell
    env = {**_shell(), "ENCODE_CLIENT_URL": server.url}  # encode-client's own default URL, moved as localhost:8000 is
    ran = subprocess.run(cmd, cwd=files, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"


def test_make_serve_serves_on_the_ports_it_is_given(tmp_path: Path) -> None:
    """README's first command, with the port variables it documents (8000 and 50051 may be taken)."""
    port = free_port()
    log = (tmp_path / "make-serve.log").open("wb")
    proc = subprocess.Popen(["make", "serve", f"PORT={port}", "GRPC_PORT=0"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "make-serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "make-serve.log").read_text()[-3000:]
            time.sleep(0.3)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/model", timeout=10).json()["model"] == "builtin:tiny"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # make and the server it runs: our own process group
        proc.wait(60)
        log.close()
