"""Start a real ``encode-server`` process on a free loopback port, and stop it by its PID.

In the test suite (``fork_servers``), servers are forked from a fork server that has imported the
server once (``tests/forkserver.py``: most of a start was importing torch and transformers),
unless the environment they are asked for differs in more than the server's own settings, or the
test asks for a fresh interpreter. Elsewhere (the benchmarks) each is a fresh interpreter."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests import startups
from tests.forkserver import ForkedProcess, forkable

__all__ = ["ServerProcess", "fork_servers", "free_port", "run_server_to_exit", "start_server"]


# `make test` runs two lanes side by side (the server's suite and the vLLM suite, Makefile): each
# takes its ports from a range of its own, below the kernel's ephemeral range (32768-60999 here,
# where bind(0) and every outgoing connection take theirs), so that neither lane is handed a port
# the other has just picked and not yet bound (a picked port is free only until its process binds).
LANE_ENV = "ENCODE_SERVER_TEST_LANE"
_LANE_PORTS = {"0": range(20000, 26000), "1": range(26000, 32000)}
_handed: deque[int] = deque(maxlen=256)  # this process's recent picks, never handed out twice in a row
_pick = random.SystemRandom()  # a test that seeds ``random`` must not make processes pick alike


def free_port() -> int:
    """A port free now: from this lane's range when ``ENCODE_SERVER_TEST_LANE`` is 0 or 1, else the
    kernel's pick (bind to port 0)."""
    ports = _LANE_PORTS.get(os.environ.get(LANE_ENV, ""))
    if ports is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(1000):
        port = _pick.choice(ports)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.append(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    grpc_port: int = 0

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)  # its exit code, set by now


def _command(python: str | None, port: int, args: tuple[str, ...]) -> list[str]:
    python = python or os.environ.get("ENCODE_SERVER_PYTHON") or sys.executable
    return [python, "-m", "encode_server", "--host", "127.0.0.1", "--port", str(port), *args]


# What the suite's servers start with unless a test says otherwise (``env``, or a flag, which wins):
# the quick warm-up (the worst case is what tests/integration/test_warmup.py runs; it costs seconds
# per start), and a Redis timeout that a saturated machine (make test's two lanes keep both cores
# busy) does not turn into misses, which the 150 ms default did; the fault tests set their own.
SUITE_DEFAULTS = {"ENCODE_SERVER_WARMUP": "quick", "ENCODE_SERVER_REDIS_TIMEOUT_MS": "2000"}


def _env(env: dict[str, str] | None) -> dict[str, str]:
    """Offline, with ``SUITE_DEFAULTS`` under the environment and ``env``."""
    return {**SUITE_DEFAULTS, **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}


class _ForkServer:
    """One fork server per Python (``tests/forkserver.py``), started at the first server asked of
    it and ended with the test process (its stdin, a pipe from here, closes). ``base`` is the
    environment and ``cwd`` the directory it was started in: what a forked server inherits."""

    def __init__(self, python: str) -> None:
        self.base = _env(None)
        self.cwd = os.getcwd()
        self._dir = tempfile.mkdtemp(prefix="encode-forkserver-")
        self.socket_path = os.path.join(self._dir, "socket")
        self.log_path = Path(self._dir, "forkserver.log")
        script = Path(__file__).with_name("forkserver.py")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen([python, str(script), self.socket_path], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=self.base, cwd=self.cwd)
        self.failed: str | None = None

    def connect(self, timeout: float) -> socket.socket | None:
        """A connection once the fork server has imported the server; None if it died."""
        deadline = time.monotonic() + timeout
        while self.failed is None:
            if os.path.exists(self.socket_path):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(self.socket_path)
                return conn
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.failed = f"fork server unavailable:\n{self.log_path.read_text(errors='replace')}"
                break
            time.sleep(0.05)
        return None

    def fork(self, cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> ForkedProcess | None:
        conn = self.connect(timeout)
        if conn is None:
            return None
        request = {"argv": cmd[3:], "env": env, "log": str(log_path)}  # cmd: python -m encode_server ARGS
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn, cmd)


# Forking is the test suite's choice (tests/conftest.py turns it on), never its helpers' default:
# the benchmarks start their servers with these helpers too, and what they time is a fresh start.
# ENCODE_TEST_FORK=0 keeps it off (every server a fresh interpreter, as before the fork server: to
# compare the seconds, or to rule it out when a test fails).
FORK_ENV = "ENCODE_TEST_FORK"
_forking = [False]
_fork_servers: dict[str, _ForkServer] = {}
_fork_lock = threading.Lock()


def fork_servers() -> None:
    """From now on, servers are forked where they can be (``tests/forkserver.py``), unless
    ``ENCODE_TEST_FORK=0``."""
    _forking[0] = os.environ.get(FORK_ENV) != "0"


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, fresh: bool,
           timeout: float) -> tuple[subprocess.Popen[bytes] | ForkedProcess, str | None]:
    """The server's process, forked when it can be (``tests/forkserver.py``), and why it was not."""
    why: str | None = "fresh=True" if fresh else None
    if _forking[0] and why is None:
        with _fork_lock:
            fork_server = _fork_servers.get(cmd[0]) or _fork_servers.setdefault(cmd[0], _ForkServer(cmd[0]))
        why = fork_server.failed or ("another working directory" if os.getcwd() != fork_server.cwd
                                     else forkable(env, fork_server.base))
        if why is None:
            forked = fork_server.fork(cmd, env, log_path, timeout)
            if forked is not None:
                return forked, None
            why = fork_server.failed
    with log_path.open("ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env), why


def run_server_to_exit(
    *args: str, port: int | None = None, timeout: float = 60.0, address_space: int | None = None
) -> tuple[int | None, str]:
    """Run a server that should not start (or should stop by itself): its exit code, or None
    when it was still running after ``timeout`` s (then it is stopped), and its output. A free
    gRPC port unless ``args`` pick one, as ``start_server``. ``address_space``: the process's
    ``RLIMIT_AS`` in bytes, so that an allocation above it fails at once on any machine."""
    if "--grpc-port" not in args:
        args = (*args, "--grpc-port", str(free_port()))
    cmd = _command(None, port or free_port(), args)
    with tempfile.TemporaryDirectory(prefix="encode-server-to-exit-") as tmp:
        log_path = Path(tmp, "server.log")
        log_path.write_bytes(b"")
        proc: subprocess.Popen[bytes] | ForkedProcess
        if address_space is None:
            proc, _ = _spawn(cmd, _env(None), log_path, False, timeout)
        else:  # a limit on the whole address space holds only from exec on: a fresh interpreter
            def limit() -> None:
                resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

            with log_path.open("ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=_env(None), preexec_fn=limit)
        code: int | None
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return code, log_path.read_text(errors="replace")


def start_server(
    *args: str, log_dir: Path, env: dict[str, str] | None = None, timeout: float = 120.0, python: str | None = None,
    fresh: bool = False,
) -> ServerProcess:
    """``python``: the interpreter with the server installed (default: this one, or
    ``ENCODE_SERVER_PYTHON``, which the vLLM tests set since their venv has no server).
    ``fresh``: exec a new interpreter rather than fork one from the fork server, for a test that
    reads what only exec sets (``/proc/PID/cmdline`` and ``environ``). Only once ``fork_servers``
    was called (the test suite's conftest) is any server forked."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    # A free gRPC port too (unless the test picks one): never the shared default 50051.
    grpc_port = 0 if "--grpc-port" in args else free_port()
    cmd = _command(python, port, args)
    if grpc_port:
        cmd += ["--grpc-port", str(grpc_port)]
    elif "--grpc-port" in args:
        grpc_port = int(args[args.index("--grpc-port") + 1])
    log_path.write_bytes(b"")
    started = time.perf_counter()
    proc, not_forked = _spawn(cmd, _env(env), log_path, fresh, timeout)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, grpc_port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                model = args[args.index("--model") + 1] if "--model" in args else "builtin:tiny"
                what = Path(model).name or model
                what += f" (not forked: {not_forked.splitlines()[0]})" if not_forked else ""
                startups.record("encode-server", what, time.perf_counter() - started)
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()}")
