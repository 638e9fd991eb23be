"""The front doors' addresses, bound before either door says it listens.

A port another process holds must fail the start, on both doors, with one line that names it.
Nothing here sets ``SO_REUSEPORT``: with it (grpc-core's default) a second replica on the same
host and port starts fine and the kernel splits connections between the two, whatever their
models, keys or tenants. ``SO_REUSEADDR`` is set, so a restart is not refused by the previous
process's connections in TIME_WAIT.
"""

from __future__ import annotations

import socket

__all__ = ["PortUnavailable", "bind_listener", "check_bindable"]

_BACKLOG = 2048  # uvicorn's default


class PortUnavailable(Exception):
    """A front door cannot bind its address (in use, or not an address of this host)."""

    def __init__(self, door: str, flag: str, host: str, port: int, reason: str) -> None:
        shown = f"[{host}]" if ":" in host else host
        super().__init__(f"{door} cannot listen on {shown}:{port} ({flag}): {reason}")


def bind_listener(door: str, flag: str, host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port``; ``PortUnavailable`` when that fails.

    It listens at once: on Linux two sockets with ``SO_REUSEADDR`` may both bind one port as
    long as neither listens, so a bound but idle socket would not hold the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise PortUnavailable(door, flag, host, port, exc.strerror or str(exc)) from None
    return sock


def check_bindable(door: str, flag: str, host: str, port: int) -> None:
    """``PortUnavailable`` unless ``host``:``port`` could be bound now (for a door that binds it
    itself, as grpc-core does: its own failure is one vague line of C++ logging)."""
    bind_listener(door, flag, host, port).close()
