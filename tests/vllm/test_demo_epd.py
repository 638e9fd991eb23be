"""``make demo-epd`` end to end, as a newcomer runs it (``scripts/demo_epd.py``): it builds its
checkpoint, starts its own Redis, encode-server, a tower-free vLLM OpenAI server with the connector
and ``encode-epd-proxy``, and prints a ``curl`` and an OpenAI-client snippet; both as printed get a
chat answer through the proxy; Ctrl-C (SIGINT) then ends the demo with status 0 and every process
it started, down to vLLM's own.
"""

from __future__ import annotations

import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The demo's output, line by line, read in a thread (None once it closes)."""
    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _until_ready(lines: queue.Queue[str | None], timeout: float) -> list[str]:
    """Every line up to the one saying how to stop it."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not seen or "Ctrl-C stops everything" not in seen[-1]:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"the demo printed no curl within {timeout:.0f} s:\n" + "\n".join(seen[-60:]))
        if line is None:
            pytest.fail("the demo exited before it was ready:\n" + "\n".join(seen[-60:]))
        seen.append(line)
    return seen


@pytest.mark.timeout(400)
def test_demo_answers_its_printed_curl_and_snippet_and_ctrl_c_ends_every_process(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "scripts.demo_epd", "--workdir", str(tmp_path), "--port", "0", "--own-redis"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines = _lines(proc)
    started: list[psutil.Process] = []
    try:
        printed = _until_ready(lines, timeout=300)
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        for member in ("redis-server", "encode_server", "vllm.entrypoints.openai.api_server", "encode_client.proxy"):
            assert member in names, names

        curl = shlex.split(next(line for line in printed if line.startswith("curl ")))
        url, body = curl[2], curl[curl.index("-d") + 1]
        answer = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"].strip()

        start = printed.index("import base64")
        snippet = "\n".join(printed[start:next(i for i in range(start, len(printed)) if printed[i].startswith("print("))
                                    + 1])
        ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0 and ran.stdout.strip(), ran.stdout + ran.stderr

        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, "\n".join(printed[-40:])
        alive = [p.pid for p in started if _running(p)]
        assert alive == [], f"left running after Ctrl-C: {alive} of {names}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for child in started:  # only after a failure: what the demo left, by PID
            if _running(child):
                child.kill()


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
