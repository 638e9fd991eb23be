"""A fork server for the suite's encode-servers: one interpreter per Python that has imported the
server (torch, transformers, every family, FastAPI, gRPC) once, and forks each server the tests
start from that state, instead of each ``python -m encode_server`` importing it all again.

Why: the suites start about 115 encode-servers, and each spent ~4.5 s of its ~5-6 s start-up
importing torch and transformers (``-X importtime``) on a machine whose two cores both lanes of
``make test`` keep busy. A forked server starts with those modules already in memory and then
does everything else a started one does, in the same order: parses its flags and environment,
loads its model, binds its ports, answers ``/ready``.

What a forked server shares with a started one, so that tests cannot tell them apart:

- it is ``python -m encode_server ARGS`` as far as Python knows: ``sys.argv``, ``sys.path[0]``
  (the working directory, as ``-m`` sets it), ``__main__`` run by ``runpy``, the interpreter's
  normal exit (atexit, logging's flush, its exit code, or death by a signal);
- its environment is exactly the one asked for; it is forked only when that environment differs
  from the fork server's own in ``ENCODE_SERVER_*`` variables alone, which nothing reads at import
  (``encode_server/config.py``), and pytest's ``PYTEST_CURRENT_TEST``. A variable a library may
  read at import (``OMP_*``, ``MALLOC_*``, ``HF_*``, ``PYTHON*``, ...) set otherwise, another
  Python or another working directory: the test helper starts a fresh interpreter instead
  (``tests/server.py``);
- its stdin is ``/dev/null``, stdout and stderr its log file, and it holds none of the fork
  server's descriptors; it is a process of its own with its own PID, which signals (SIGTERM's
  drain, SIGKILL), ``/proc/PID`` (RSS, open descriptors) and the handle's ``wait`` see as usual;
- Python's and numpy's global random generators are seeded afresh (a fork copies their state).

Nothing in the fork server has started a thread of torch or OpenMP when it forks: importing torch
starts no pool (its pools start with the first parallel operation, which only a server runs), and
OpenBLAS's pool, which importing numpy starts, is shut down around each fork by its own
``pthread_atfork`` handler. What differs, and no test reads: ``/proc/PID/cmdline`` and
``/proc/PID/environ`` show what the fork server was exec'd with (a test that reads them asks
``start_server(..., fresh=True)``), and the hash seed of ``str`` is the fork server's.

Protocol, over a Unix socket, one connection per server: the test sends one JSON line (``argv``,
``env``, ``log``); the fork server answers ``{"pid": N}`` once forked and ``{"returncode": R}``
when it has reaped it (``-N``: killed by signal N, as ``subprocess`` says it). The fork server
ends when its stdin (a pipe from the test process) closes.

Run as ``python tests/forkserver.py SOCKET`` (never imports ``tests``, so that a forked server's
modules are the server's own).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["ForkRequest", "ForkedProcess", "forkable", "main"]

# What the fork server imports before it forks: the server's whole import graph (its families,
# torch and transformers with them). Only imports: nothing here may start a thread or a loop.
PRELOAD = ("encode_server.cli",)

# The variables in which a forked server's environment may differ from the fork server's: the
# server's own settings, read when it parses them (config.settings_from), never at import; and the
# name of the test pytest is running, which pytest sets in its own environment for each test.
FORKABLE_PREFIX = "ENCODE_SERVER_"
FORKABLE_NAMES = frozenset({"PYTEST_CURRENT_TEST"})


@dataclass(frozen=True)
class ForkRequest:
    argv: list[str]  # the server's arguments, after ``python -m encode_server``
    env: dict[str, str]  # its whole environment
    log: str  # its stdout and stderr


def main(socket_path: str) -> ForkRequest | None:
    """Import the server, then serve fork requests until stdin closes: None in the fork server
    (it should exit), the request in a forked child (it should run the server)."""
    sys.path[0] = os.getcwd()  # what ``python -m`` puts there, not this file's directory
    original = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    imported = dict(os.environ)  # with what importing set (encoders: OMP_WAIT_POLICY's default)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        sys.exit("CUDA was initialised while importing the server: no forking")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # connectable only once it is ready
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request = _read_request(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    for other in children.values():
                        other.close()
                    sel.close()
                    listener.close()
                    _become_child(request, original, imported)
                    return request
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            elif not os.read(sys.stdin.fileno(), 4096):  # the test process is gone
                return None
        _reap(children)


def _read_request(conn: socket.socket) -> ForkRequest:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("fork request cut short")
        data += chunk
    fields = json.loads(data)
    return ForkRequest(argv=list(fields["argv"]), env=dict(fields["env"]), log=str(fields["log"]))


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid)
        with contextlib.suppress(OSError):  # OSError: the test dropped its handle, nobody waits
            conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        conn.close()


def _become_child(request: ForkRequest, original: dict[str, str], imported: dict[str, str]) -> None:
    """The forked process's state as ``python -m encode_server`` would have it before its main."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # The environment asked for, plus what importing set where it asked nothing else.
    env = dict(request.env)
    for key, value in imported.items():
        if key not in original and key not in request.env:
            env[key] = value
    os.environ.clear()
    os.environ.update(env)
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *request.argv]


def forkable(env: dict[str, str], base: dict[str, str]) -> str | None:
    """Why a server with ``env`` cannot be forked from a fork server started with ``base``, or None."""
    differ = sorted(k for k in set(env) | set(base)
                    if env.get(k) != base.get(k) and not k.startswith(FORKABLE_PREFIX) and k not in FORKABLE_NAMES)
    return f"environment differs: {', '.join(differ)}" if differ else None


class ForkedProcess:
    """The test's handle on a forked server, with the part of ``subprocess.Popen``'s surface the
    tests use: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``.
    The fork server (its parent) reaps it and sends its exit code on the connection."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self._conn = conn
        self._buffer = b""
        self.args = args
        self.pid = int(self._message(None)["pid"])
        self.returncode: int | None = None

    def _message(self, timeout: float | None) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            chunk = self._conn.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._message(timeout)["returncode"])
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


if __name__ == "__main__":
    child = main(sys.argv[1])
    if child is None:
        sys.exit(0)
    import runpy

    runpy.run_module("encode_server", run_name="__main__", alter_sys=True)
