"""API keys and the tenant each one stands for (docs/api.md).

Shared by the HTTP and gRPC front doors: both hand over the ``Authorization`` value they received
and get back the tenant id, or ``Unauthorized``.

Invariants:
- A presented key is compared with *every* configured key, in constant time, without an early
  exit: how long a check takes says nothing about which key, or how much of one, matched. The
  comparison is over BLAKE3 digests, so key lengths do not show either.
- No key, nor any part of one, is ever put in a message, an error body or a log line.
- A key without a tenant authenticates to tenant ``None``: with ``--tenant-isolation`` such keys
  share the default namespace (the cache keys of a server without isolation).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import blake3

from encode_server.config import Settings
from encode_server.core.errors import Unauthorized

__all__ = ["ApiKeys", "parse_api_keys"]

_SCHEME = "bearer"


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: str | None


def _digest(secret: str) -> bytes:
    return blake3.blake3(secret.encode("utf-8", "surrogatepass")).digest()


def parse_api_keys(spec: str) -> list[tuple[str | None, str]]:
    """``"k1,acme:k2"`` -> ``[(None, "k1"), ("acme", "k2")]``; errors name positions, never keys."""
    out: list[tuple[str | None, str]] = []
    for position, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        tenant, sep, secret = entry.partition(":")
        if not sep:
            tenant, secret = "", entry
        tenant, secret = tenant.strip(), secret.strip()
        if not secret or any(c.isspace() for c in secret) or (sep and not tenant):
            raise ValueError(f"API key #{position} is malformed: expected KEY or TENANT:KEY without spaces")
        out.append((tenant or None, secret))
    return out


class ApiKeys:
    """The configured keys. Build it once per server with :meth:`from_settings`."""

    def __init__(self, keys: list[tuple[str | None, str]]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key (use None for an open server)")
        by_digest: dict[bytes, str | None] = {}
        for tenant, secret in keys:
            digest = _digest(secret)
            if digest in by_digest and by_digest[digest] != tenant:
                raise ValueError("one API key is configured for two different tenants")
            by_digest[digest] = tenant
        self._keys = tuple(_Key(d, t) for d, t in by_digest.items())

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys | None:
        """``--api-key`` plus ``--api-keys``; None when neither is set (every route is open)."""
        keys: list[tuple[str | None, str]] = []
        for spec in (settings.api_key, settings.api_keys):
            if spec:
                keys.extend(parse_api_keys(spec))
        return cls(keys) if keys else None

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tenants(self) -> frozenset[str | None]:
        return frozenset(k.tenant for k in self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} keys)"

    def authenticate(self, authorization_header: str | None) -> str | None:
        """The tenant of the presented ``Bearer`` key (None for a key without one).

        Raises ``Unauthorized`` (401 ``unauthorized``) for a missing, malformed or unknown key.
        """
        if not authorization_header:
            raise Unauthorized("missing 'Authorization: Bearer <key>' header")
        scheme, _, token = authorization_header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != _SCHEME or not token:
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        presented = _digest(token)
        matched: _Key | None = None
        for key in self._keys:  # every key, every time: no early exit
            if hmac.compare_digest(presented, key.digest):
                matched = key
        if matched is None:
            raise Unauthorized("invalid API key")
        return matched.tenant
