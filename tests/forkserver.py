"""A fork server for the suite's encode-servers: an interpreter that has imported the server
(torch, transformers, every family, FastAPI, gRPC) once, and forks each server the tests start
from that state, instead of each ``python -m encode_server`` importing it all again.

Why: the suites start about 115 encode-servers, and each spent ~4.5 s of its ~5-6 s start-up
importing torch and transformers (``-X importtime``) on a machine whose two cores both lanes of
``make test`` keep busy. A forked server starts with those modules already in memory and then
does everything else a started one does, in the same order: parses its flags and environment,
loads its model, binds its ports, answers ``/ready``.

What a forked server shares with a started one, so that tests cannot tell them apart:

- it is ``python -m encode_server ARGS`` as far as Python knows: ``sys.argv``, ``sys.path[0]``
  (the working directory, as ``-m`` sets it), ``__main__`` run by ``runpy``, the interpreter's
  normal exit (atexit, logging's flush, its exit code, or death by a signal);
- its environment is exactly the one asked for, and it is forked from a fork server whose own
  differs from it in ``ENCODE_SERVER_*`` variables alone, which nothing reads at import
  (``encode_server/config.py``), and pytest's ``PYTEST_CURRENT_TEST``: a variable a library or the
  loader may read at start (``OMP_*``, ``MALLOC_*``, ``HF_*``, ``LD_LIBRARY_PATH``, ...) set
  otherwise, or another working directory, and the test helper starts another fork server for it
  (``tests/server.py``; the vLLM tests' process gains an ``LD_LIBRARY_PATH`` after their first
  stack);
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
``env``, ``log``, ``session``: a session of its own, as ``Popen``'s ``start_new_session``); the
fork server answers ``{"pid": N}`` once forked and ``{"returncode": R}`` when it has reaped it
(``-N``: killed by signal N, as ``subprocess`` says it). The fork server ends when its stdin (a
pipe from the test process) closes.

The same serves vLLM's OpenAI server (``tests/vllm/epd_stack.py``), whose start was a third
importing vLLM (``python -m vllm.entrypoints.openai.api_server``, its engine in the same process).

Run as ``python tests/forkserver.py SOCKET MODULE``: it imports what ``MODULE`` imports (only
imports, nothing that starts a thread or a loop; never ``tests``, so that a forked server's
modules are its own).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import select
import selectors
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ForkRequest", "ForkedProcess", "import_environment", "main", "preload"]

# The variables in which a forked server's environment may differ from the fork server's: the
# server's own settings, read when it parses them (config.settings_from), never at import; and the
# name of the test pytest is running, which pytest sets in its own environment for each test.
FORKABLE_PREFIX = "ENCODE_SERVER_"
FORKABLE_NAMES = frozenset({"PYTEST_CURRENT_TEST"})


@dataclass(frozen=True)
class ForkRequest:
    argv: list[str]  # the server's arguments, after ``python -m MODULE``
    env: dict[str, str]  # its whole environment
    log: str  # its stdout and stderr
    session: bool  # a session (and process group) of its own, as Popen's start_new_session


def main(socket_path: str, module: str) -> ForkRequest | None:
    """Import what ``python -m module`` imports first, then serve fork requests until stdin
    closes: None in the fork server (it should exit), the request in a forked child (it should
    run ``module`` as ``__main__``)."""
    sys.path[0] = os.getcwd()  # what ``python -m`` puts there, not this file's directory
    original = dict(os.environ)
    preload(module)
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


def preload(module: str) -> None:
    """Import the modules ``module``'s code imports at its top level (a package's: its
    ``__main__``'s), and their graph with them, never ``module`` itself: ``-m`` runs it as
    ``__main__`` only, and its module-level state (a metric registered on import) must be made
    once, in the forked child."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(module + ".__main__")
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            name = importlib.util.resolve_name("." * node.level + (node.module or ""), spec.parent or None)
            imported = importlib.import_module(name)
            for alias in node.names:  # a submodule named in ``from package import name``
                if alias.name != "*" and not hasattr(imported, alias.name):
                    importlib.import_module(f"{name}.{alias.name}")


def _read_request(conn: socket.socket) -> ForkRequest:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("fork request cut short")
        data += chunk
    fields = json.loads(data)
    return ForkRequest(argv=list(fields["argv"]), env=dict(fields["env"]), log=str(fields["log"]),
                       session=bool(fields["session"]))


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
    """The forked process's state as ``python -m MODULE`` would have it before its main."""
    if request.session:
        os.setsid()
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


def import_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a fork server must have been started with for a process with ``env``
    to be forked from it: all but the variables read after import (``FORKABLE_PREFIX``,
    ``FORKABLE_NAMES``). A process whose part differs gets a fork server of its own."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if not k.startswith(FORKABLE_PREFIX) and k not in FORKABLE_NAMES))


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
    main_module = sys.argv[2]
    if main(sys.argv[1], main_module) is None:
        sys.exit(0)
    import runpy

    runpy.run_module(main_module, run_name="__main__", alter_sys=True)
