"""The store key of an embedding, built from its parts, for readers that only know an ``mm_hash``.

A prefill worker's EC connector is asked for an image by its ``mm_hash`` alone: it rebuilds the key
the server wrote, ``{prefix}:v1:{fingerprint}:{mm_hash}``, or with tenant isolation
``{prefix}:v1:{fingerprint}:t:{tenant_digest}:{mm_hash}`` (DESIGN.md section 1). The layout is the
server's; a test checks this copy against it, because the client never imports the server.
"""

from __future__ import annotations

import re

from blake3 import blake3

__all__ = ["KEY_VERSION", "store_key", "tenant_digest"]

KEY_VERSION = "v1"
_TENANT_DOMAIN = "encode-server/tenant/v1"
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")


def _framed_str(value: str) -> bytes:
    payload = value.encode("utf-8", "surrogatepass")
    return b"s" + len(payload).to_bytes(8, "little") + payload


def tenant_digest(tenant: str) -> str:
    """The key's tenant segment: BLAKE3 of the framed pair (domain, tenant), as the server frames it."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string (None for no tenant isolation)")
    framed = b"l" + (2).to_bytes(8, "little") + _framed_str(_TENANT_DOMAIN) + _framed_str(tenant)
    return blake3(framed).hexdigest()


def store_key(fingerprint: str, mm_hash: str, *, prefix: str = "encode", tenant: str | None = None) -> str:
    """The Redis key under which the server stores ``mm_hash``'s embedding for ``fingerprint``."""
    for name, value in (("fingerprint", fingerprint), ("mm_hash", mm_hash)):
        if not isinstance(value, str) or _LOWER_HEX64.fullmatch(value) is None:
            raise ValueError(f"{name} must be 64 lowercase hex digits, got {value!r}")
    if not prefix or not prefix.isprintable() or any(c.isspace() for c in prefix):
        raise ValueError(f"prefix must be a non-empty printable string without whitespace, got {prefix!r}")
    if tenant is None:
        return f"{prefix}:{KEY_VERSION}:{fingerprint}:{mm_hash}"
    return f"{prefix}:{KEY_VERSION}:{fingerprint}:t:{tenant_digest(tenant)}:{mm_hash}"
