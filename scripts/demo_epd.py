"""``make demo-epd``: the whole EPD stack on one CPU machine, answering a chat with an image.

It brings up, in order: a Redis (the one on 127.0.0.1:6379 when it answers, else a
``redis-server`` of its own on a free port), the tiny Qwen2.5-VL checkpoint ``make checkpoint``
writes (built once into the work directory), encode-server serving it, vLLM's OpenAI server as a
tower-free EC consumer with ``EncodeServerECConnector``, and ``encode-epd-proxy`` in front; then it
prints the proxy's URL, a ``curl`` and an OpenAI-client snippet that send it a chat with an image,
and waits. Ctrl-C (SIGINT) or SIGTERM stops every process it started, the proxy first, and then
any process of theirs still running, by its PID. A process that dies on its own stops the rest.

The pieces are the ones the tests run (``tests/server.py``'s ``start_server``,
``tests/vllm/epd_stack.py``'s ``vllm_openai_server``, ``tests/redis_procs.py``), so the demo is
the stack they prove. Run by vLLM's CPU environment (``scripts/vllm_env.sh``) with
``ENCODE_SERVER_PYTHON`` the project's ``.venv`` Python and ``PYTHONPATH`` the repository and
``clients/python``, as ``make test-vllm`` runs its tests. The checkpoint's weights are random: the
answers are words without meaning.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import inspect
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

__all__ = ["chat_request", "main"]

ROOT = Path(__file__).resolve().parent.parent
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
PREFIX = "encode-demo"
SERVED_NAME = "tiny"  # the name vLLM serves the checkpoint under (tests/vllm/epd_stack.py)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _stop(*_: Any) -> None:
    raise KeyboardInterrupt


def sample_png() -> bytes:
    """A 56x56 PNG of four coloured squares: one patch grid, a few hundred bytes of base64."""
    from PIL import Image

    image = Image.new("RGB", (56, 56))
    for i, colour in enumerate([(200, 30, 30), (30, 160, 40), (40, 60, 220), (240, 220, 40)]):
        image.paste(colour, (28 * (i % 2), 28 * (i // 2), 28 * (i % 2) + 28, 28 * (i // 2) + 28))
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def chat_request(image: bytes) -> dict[str, Any]:
    """The chat the printed ``curl`` sends: the image as a ``data:`` URL, then a question."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe the image"}]
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 16}


def _snippet(base_url: str, image_path: Path) -> str:
    return f'''import base64
from openai import OpenAI

client = OpenAI(base_url="{base_url}/v1", api_key="unused")
image = "data:image/png;base64," + base64.b64encode(open("{image_path}", "rb").read()).decode()
answer = client.chat.completions.create(model="{SERVED_NAME}", max_tokens=16, messages=[{{"role": "user", "content": [
    {{"type": "image_url", "image_url": {{"url": image}}}}, {{"type": "text", "text": "describe the image"}}]}}])
print(answer.choices[0].message.content)'''


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


@contextlib.contextmanager
def _redis(url: str | None, own: bool) -> Iterator[tuple[str, bool]]:
    """(the Redis URL, whether it is this demo's own): ``url`` when given, the local one when it
    answers (unless ``own``), else a ``redis-server`` started here and killed on exit."""
    from tests.redis_procs import require_redis_binaries, start_redis

    if url is not None or (not own and _redis_answers(LOCAL_REDIS)):
        yield url or LOCAL_REDIS, False
        return
    try:
        require_redis_binaries()
    except RuntimeError as exc:
        raise SystemExit(f"no Redis answers on 127.0.0.1:6379 and none can be started here: {exc} "
                         "(or brew install redis), or pass --redis-url redis://HOST:PORT/0") from exc
    with start_redis() as server:
        yield server.url, True


def _checkpoint(workdir: Path) -> Path:
    """The default tiny checkpoint of ``make checkpoint``, built once into ``workdir`` (again when
    its builder's module changes)."""
    from scripts.tiny_checkpoint import DEFAULT, builders

    build = builders()[DEFAULT][0]
    func = build.func if isinstance(build, functools.partial) else build
    key = hashlib.sha256(Path(inspect.getfile(func)).read_bytes()).hexdigest()[:12]
    path = workdir / f"checkpoint-{DEFAULT}-{key}"
    if not (path / ".complete").exists():
        _say(f"building the tiny {DEFAULT} checkpoint (Qwen2.5-VL, random weights) in {path}")
        build(path)
        (path / ".complete").touch()
    return path


@contextlib.contextmanager
def _proxy(port: int, vllm_url: str, encoder_url: str, logs: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``encode-epd-proxy`` from the project's environment, in a session of its own, stopped by
    SIGTERM (it drains what is in flight)."""
    python = os.environ.get("ENCODE_SERVER_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    cmd = [python, "-m", "encode_client.proxy", "--listen", f"127.0.0.1:{port}", "--vllm", vllm_url,
           "--encoder", encoder_url, "--drain-seconds", "5"]
    url = f"http://127.0.0.1:{port}"
    with (logs / "proxy.log").open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"encode-epd-proxy exited with {proc.returncode}; see {logs / 'proxy.log'}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"encode-epd-proxy not ready after 60 s; see {logs / 'proxy.log'}")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _end_descendants() -> None:
    """Whatever this process started that still runs (a process a stack member started and left
    behind, or one started while a signal cut its start short): SIGTERM, then SIGKILL, by PID."""
    import psutil

    left = psutil.Process().children(recursive=True)
    for child in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(left, timeout=10)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=5)


def _environment() -> None:
    """What vLLM's CPU build needs on a laptop, as the tests and benchmarks run it: a small KV
    cache (its default, a share of all memory, refuses to start on a busy machine), the model in
    the engine-core process, idle OpenMP threads that sleep, nothing downloaded."""
    for name, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_WAIT_POLICY": "PASSIVE",
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(name, value)


def _serve(args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    import redis

    from tests.redis_procs import delete_prefix
    from tests.server import free_port, port_free, start_server
    from tests.vllm.epd_stack import vllm_openai_server

    workdir: Path = args.workdir
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    if not port_free(port):
        if args.port != 8080:
            raise SystemExit(f"port {port} is taken; pick another with --port (0: any)")
        port = free_port()
    model = _checkpoint(workdir)
    redis_url, own = stack.enter_context(_redis(args.redis_url, args.own_redis))
    if not own:  # someone else's Redis: leave it as it was
        stack.callback(lambda: delete_prefix(redis.Redis.from_url(redis_url), PREFIX))
    _say(f"Redis: {redis_url} ({'started here' if own else 'already running'})")
    _say("starting encode-server")
    server = start_server("--model", str(model), "--redis-url", redis_url, "--cache-prefix", PREFIX,
                          "--grpc-port", "0", "--dtype", "float32", log_dir=logs)
    stack.callback(server.stop)
    _say(f"encode-server on {server.url}; starting vLLM's OpenAI server, a tower-free EC consumer (a minute or so)")
    extra = {"redis_url": redis_url, "encoder_url": server.url, "prefix": PREFIX}
    vllm = stack.enter_context(vllm_openai_server(model, extra, logs))
    url, proxy = stack.enter_context(_proxy(port, vllm["url"], server.url, logs))
    image_path = workdir / "demo.png"
    image_path.write_bytes(sample_png())
    body = json.dumps(chat_request(image_path.read_bytes()))
    curl = (f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}")
    print(f"\nEPD stack ready: encode-epd-proxy on {url} (OpenAI base URL {url}/v1, model {SERVED_NAME!r})\n"
          f"  encode-server {server.url}, vLLM {vllm['url']} (tower-free, the connector), Redis {redis_url}\n"
          f"  logs in {logs}\n\n"
          f"A chat with an image ({image_path}, inline as a data: URL):\n\n{curl}\n\n"
          f"The same with the OpenAI client (in a Python that has openai; vLLM's environment does):\n\n"
          f"{_snippet(url, image_path)}\n\n"
          "The weights are random: the answer is words without meaning. Ctrl-C stops everything.", flush=True)
    members = {"encode-server": server.proc, "encode-epd-proxy": proxy}
    while True:
        time.sleep(1)
        for name, proc in members.items():
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {logs}; stopping the rest")
        try:
            healthy = httpx.get(vllm["url"] + "/health", timeout=5).status_code == 200
        except httpx.ConnectError:
            healthy = False
        except httpx.TransportError:  # slow to answer while it works: not a failure
            healthy = True
        if not healthy:
            raise SystemExit(f"vLLM's OpenAI server stopped answering; see {logs}; stopping the rest")


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("ENCODE_SERVER_CACHE", Path.home() / ".cache" / "encode-server"))
    parser = argparse.ArgumentParser(prog="make demo-epd", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8080,
                        help="the proxy's port on 127.0.0.1 (default 8080, or a free one if taken; 0: any)")
    parser.add_argument("--workdir", type=Path, default=cache / "demo-epd",
                        help="the checkpoint, the sample image and the logs (default %(default)s)")
    parser.add_argument("--redis-url", help=f"a Redis to use (default: {LOCAL_REDIS} if it answers, else our own)")
    parser.add_argument("--own-redis", action="store_true", help="start a redis-server even if one answers on 6379")
    args = parser.parse_args(argv)
    _environment()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too where a shell started it ignoring SIGINT (`&`)
        signal.signal(sig, _stop)
    with contextlib.ExitStack() as stack:
        stack.callback(_end_descendants)
        try:
            _serve(args, stack)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _say("\nstopping: encode-epd-proxy, vLLM, encode-server, Redis")
    _say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
