"""Start a real ``encode-server`` process on a free loopback port, and stop it by its PID.

In the test suite (``fork_servers``), servers are forked from a fork server that has imported the
server once (``tests/forkserver.py``: most of a start was importing torch and transformers),
one per environment but for the server's own settings, unless the test asks for a fresh
interpreter. Elsewhere (the benchmarks) each is a fresh interpreter."""

from __future__ import annotations

import atexit
import json
import os
import random
import resource
import shutil
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
from tests.forkserver import ForkedProcess, import_environment

__all__ = ["ServerProcess", "end_group", "fork_servers", "free_port", "port_free", "run_server_to_exit",
           "start_module", "start_server"]


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
        if port in _handed or not port_free(port):
            continue
        _handed.append(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session``: a server and
    what it started), SIGKILL if it is still there after ``grace_s``; nothing if it has ended."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def port_free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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
    """A fork server (``tests/forkserver.py``), started at the first process asked of it and ended
    with the test process (its stdin, a pipe from here, closes; never before, since it reaps the
    processes it forked). ``base`` is the environment and ``cwd`` the directory it was started in:
    what a forked process inherits."""

    def __init__(self, python: str, module: str, base: dict[str, str]) -> None:
        self.base = base
        self.cwd = os.getcwd()
        self._dir = tempfile.mkdtemp(prefix="encode-forkserver-")
        atexit.register(shutil.rmtree, self._dir, ignore_errors=True)  # its socket and log
        self.socket_path = os.path.join(self._dir, "socket")
        self.log_path = Path(self._dir, "forkserver.log")
        script = Path(__file__).with_name("forkserver.py")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen([python, str(script), self.socket_path, module],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=base,
                                         cwd=self.cwd)
        self.failed: str | None = None

    def connect(self, timeout: float) -> socket.socket | None:
        """A connection once the fork server has imported the module; None if it died."""
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

    def fork(self, cmd: list[str], env: dict[str, str], log_path: Path, timeout: float,
             session: bool) -> ForkedProcess | None:
        conn = self.connect(timeout)
        if conn is None:
            return None
        request = {"argv": cmd[3:], "env": env, "log": str(log_path), "session": session}  # cmd: python -m M ARGS
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn, cmd)


# Forking is the test suite's choice (tests/conftest.py turns it on), never its helpers' default:
# the benchmarks start their servers with these helpers too, and what they time is a fresh start.
# ENCODE_TEST_FORK=0 keeps it off (every server a fresh interpreter, as before the fork server: to
# compare the seconds, or to rule it out when a test fails).
FORK_ENV = "ENCODE_TEST_FORK"
_forking = [False]
_fork_servers: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], _ForkServer] = {}
_fork_lock = threading.Lock()


def fork_servers() -> None:
    """From now on, servers are forked where they can be (``tests/forkserver.py``), unless
    ``ENCODE_TEST_FORK=0``."""
    _forking[0] = os.environ.get(FORK_ENV) != "0"


def start_module(
    cmd: list[str], env: dict[str, str], log_path: Path, *, fresh: bool = False, new_session: bool = False,
    timeout: float = 120.0,
) -> tuple[subprocess.Popen[bytes] | ForkedProcess, str | None]:
    """``cmd`` (``PYTHON -m MODULE ARGS``) with ``env``, its output into ``log_path``: forked from
    a fork server of that Python and module when forking is on (``fork_servers``) and ``fresh`` is
    not set, else a fresh interpreter; and why it was not forked.
    ``new_session``: a session and process group of its own (``Popen``'s ``start_new_session``)."""
    why: str | None = "fresh=True" if fresh else None
    if _forking[0] and why is None:
        # One fork server per Python, module, directory and what of the environment is read at start.
        key = (cmd[0], cmd[2], os.getcwd(), import_environment(env))
        with _fork_lock:
            fork_server = _fork_servers.get(key) or _fork_servers.setdefault(key, _ForkServer(cmd[0], cmd[2], env))
        forked = fork_server.fork(cmd, env, log_path, timeout, new_session)
        if forked is not None:
            return forked, None
        why = fork_server.failed
    with log_path.open("ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=new_session), why


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
            proc, _ = start_module(cmd, _env(None), log_path, timeout=timeout)
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
    proc, not_forked = start_module(cmd, _env(env), log_path, fresh=fresh, timeout=timeout)
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
