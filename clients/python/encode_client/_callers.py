"""The proxy's callers: API keys, each optionally standing for a tenant.

The same ``KEY`` / ``TENANT:KEY`` list as encode-server's ``ENCODE_SERVER_API_KEYS`` (a test checks
that both read it alike): the proxy authenticates a caller by its ``Authorization: Bearer KEY`` and
talks to encode-server with that same key, so encode-server puts the caller's images under the
caller's tenant. Invariants: a presented key is compared with every configured key, in constant
time over BLAKE3 digests, without an early exit; no key is ever put in a message or a log line.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass, field

from blake3 import blake3

__all__ = ["Caller", "Callers"]


@dataclass(frozen=True)
class Caller:
    tenant: str | None
    key: str = field(repr=False)


def _digest(secret: str) -> bytes:
    return blake3(secret.encode("utf-8", "surrogatepass")).digest()


class Callers:
    """The configured keys (``"k1,acme:k2"``); errors name positions, never keys."""

    def __init__(self, spec: str) -> None:
        callers: dict[bytes, Caller] = {}
        for position, raw in enumerate(spec.split(","), start=1):
            entry = raw.strip()
            if not entry:
                continue
            tenant, sep, secret = entry.partition(":") if ":" in entry else ("", "", entry)
            tenant, secret = tenant.strip(), secret.strip()
            if not secret or any(c.isspace() for c in secret) or (sep and not tenant):
                raise ValueError(f"API key #{position} is malformed: expected KEY or TENANT:KEY without spaces")
            caller = Caller(tenant or None, secret)
            if callers.get(_digest(secret), caller) != caller:
                raise ValueError(f"API key #{position} is configured for two different tenants")
            callers[_digest(secret)] = caller
        if not callers:
            raise ValueError("no API keys given")
        self._callers = tuple(callers.items())

    def __iter__(self) -> Iterator[Caller]:
        return (caller for _, caller in self._callers)

    def __len__(self) -> int:
        return len(self._callers)

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller presenting ``Authorization: Bearer KEY``; None for a missing or unknown key."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented, matched = _digest(token.strip()), None
        for digest, caller in self._callers:  # every key, every time: no early exit
            if hmac.compare_digest(presented, digest):
                matched = caller
        return matched
