"""The container's HEALTHCHECK: ``GET /health`` on the address the server really listens on.

The port may come from a flag (``--port 9000``, ``--port=9000``), from ``ENCODE_SERVER_PORT``, or
from the default, and a probe that reads only the environment calls a healthy server started with
``--port`` unhealthy. So the probe finds the server's process in ``/proc``, reads its command line
and environment, and resolves them with the server's own parser (``settings_from``): the probe
reaches the conclusion the server reached. Nothing is written anywhere, so it works on a read-only
root filesystem, and nothing in the server has to cooperate.

Run as ``python -m encode_server.healthcheck``; exit 0 when healthy, 1 otherwise (Docker's codes),
with the reason on stdout, which ``docker inspect`` and ``podman healthcheck run`` show.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from encode_server.config import Settings, settings_from

__all__ = ["find_server", "health_url", "main", "server_args"]

_PROGRAM = "encode-server"
_MODULE = "encode_server"


def server_args(argv: Sequence[str]) -> list[str] | None:
    """The flags of an ``encode-server`` command line, or None when it is not the server.

    Recognises the console script, run directly (``encode-server ...``) or through its shebang
    (``python /opt/venv/bin/encode-server ...``), and ``python -m encode_server ...``.
    """
    for i, arg in enumerate(argv[:2]):
        if os.path.basename(arg) == _PROGRAM:
            return list(argv[i + 1 :])
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == _MODULE:
            return list(argv[i + 2 :])
    return None


def _read_nul_separated(path: Path) -> list[str]:
    return [part.decode(errors="surrogateescape") for part in path.read_bytes().split(b"\0") if part]


def find_server(proc: Path = Path("/proc")) -> tuple[list[str], dict[str, str]] | None:
    """The flags and environment of the lowest-numbered server process (PID 1 unless an init runs
    first, as with ``docker run --init``), or None when there is none."""
    pids = sorted(int(p.name) for p in proc.iterdir() if p.name.isdigit())
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            args = server_args(_read_nul_separated(proc / str(pid) / "cmdline"))
            if args is None:
                continue
            environ = dict(
                entry.split("=", 1) for entry in _read_nul_separated(proc / str(pid) / "environ") if "=" in entry
            )
        except OSError:  # gone meanwhile, or not ours to read
            continue
        return args, environ
    return None


def health_url(settings: Settings) -> str:
    """Where the server answers from inside its own network namespace: a wildcard bind is reached
    on loopback, a specific address on itself."""
    host = settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}/health"


def main(argv: Sequence[str] | None = None, proc: Path = Path("/proc"), timeout: float = 3.0) -> int:
    del argv  # no options: everything comes from the server's own command line
    found = find_server(proc)
    if found is None:
        print("unhealthy: no encode-server process found")
        return 1
    args, environ = found
    try:
        settings = settings_from(args, environ)
    except SystemExit as exc:  # the server would have refused these too
        print(f"unhealthy: cannot read the server's settings: {exc}")
        return 1
    url = health_url(settings)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = response.status
    except OSError as exc:
        print(f"unhealthy: {url}: {exc}")
        return 1
    print(f"healthy: {url} answered {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
