"""Store keys, and the identifiers the EPD path gives vLLM for them, built from their parts.

A prefill worker's EC connector is asked for an image by an identifier alone: it rebuilds the key
the server wrote, ``{prefix}:v1:{fingerprint}:{mm_hash}``, or with tenant isolation
``{prefix}:v1:{fingerprint}:t:{tenant_digest}:{mm_hash}`` (DESIGN.md section 1). The layout is the
server's; a test checks this copy against it, because the client never imports the server.

Identifiers (what vLLM sees as an item's ``uuid``; docs/vllm.md, "Threat model"): the tail of the
store key after the fingerprint, so that the key is always ``{prefix}:v1:{fingerprint}:{identifier}``:

- ``{mm_hash}``: an image stored without a tenant;
- ``t:{tenant_digest}:{mm_hash}``: an image stored for a tenant. Two tenants sending one image get
  two identifiers, so they never share an entry of vLLM's encoder, processor or prefix cache, and
  the connector reads each from its own tenant's key;
- ``e:{digest}``: a client's own embedding that a trusted caller may send (``--trust-client-embeds``),
  named by the content hash of its payload. It is never a store key: the connector never looks it
  up, and it can never equal an image's identifier (another shape, and BLAKE3 in its key-derivation
  mode, whose outputs are apart from every plain BLAKE3 digest such as an ``mm_hash``).

Every identifier is computed by the proxy or the server from bytes; none is ever a client's.
"""

from __future__ import annotations

import json
import re

from blake3 import blake3

__all__ = ["KEY_VERSION", "embeds_identifier", "epd_identifier", "identifier_key", "store_key", "tenant_digest"]

KEY_VERSION = "v1"
_TENANT_DOMAIN = "encode-server/tenant/v1"
# BLAKE3's derive_key mode: a context string, globally unique and fixed (the BLAKE3 paper's rule).
_EMBEDS_CONTEXT = "encode-server 2025-12 EPD client embeddings identifier v1"
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")
_STORED_IDENTIFIER = re.compile(r"(?:t:[0-9a-f]{64}:)?[0-9a-f]{64}")


def _framed_str(value: str) -> bytes:
    payload = value.encode("utf-8", "surrogatepass")
    return b"s" + len(payload).to_bytes(8, "little") + payload


def _check_hex(name: str, value: object) -> None:
    if not isinstance(value, str) or _LOWER_HEX64.fullmatch(value) is None:
        raise ValueError(f"{name} must be 64 lowercase hex digits, got {value!r}")


def _check_prefix(prefix: str) -> None:
    if not prefix or not prefix.isprintable() or any(c.isspace() for c in prefix):
        raise ValueError(f"prefix must be a non-empty printable string without whitespace, got {prefix!r}")


def tenant_digest(tenant: str) -> str:
    """The key's tenant segment: BLAKE3 of the framed pair (domain, tenant), as the server frames it."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string (None for no tenant isolation)")
    framed = b"l" + (2).to_bytes(8, "little") + _framed_str(_TENANT_DOMAIN) + _framed_str(tenant)
    return blake3(framed).hexdigest()


def store_key(fingerprint: str, mm_hash: str, *, prefix: str = "encode", tenant: str | None = None) -> str:
    """The Redis key under which the server stores ``mm_hash``'s embedding for ``fingerprint``."""
    _check_hex("fingerprint", fingerprint)
    _check_hex("mm_hash", mm_hash)
    _check_prefix(prefix)
    if tenant is None:
        return f"{prefix}:{KEY_VERSION}:{fingerprint}:{mm_hash}"
    return f"{prefix}:{KEY_VERSION}:{fingerprint}:t:{tenant_digest(tenant)}:{mm_hash}"


def epd_identifier(key: str, mm_hash: str) -> str:
    """The identifier vLLM gets for the image ``mm_hash`` that the server stored under ``key``.

    ``key`` is the hand-off's answer; it is read from the right (the server's rule: the last segment
    is the ``mm_hash``, the one two before it is ``t`` exactly when a tenant is present) and must be
    a well-formed key of exactly this image. Raises ``ValueError`` otherwise."""
    _check_hex("mm_hash", mm_hash)
    parts = key.split(":") if isinstance(key, str) else []
    identifier = f"t:{parts[-2]}:{mm_hash}" if len(parts) >= 6 and parts[-3] == "t" else mm_hash
    head, _, fingerprint = key[: -len(identifier) - 1].rpartition(":") if parts else ("", "", "")
    prefix, _, version = head.rpartition(":")
    if (
        not key.endswith(":" + identifier)
        or _STORED_IDENTIFIER.fullmatch(identifier) is None
        or _LOWER_HEX64.fullmatch(fingerprint) is None
        or version != KEY_VERSION
        or not prefix
    ):
        raise ValueError(f"{key!r} is not a store key of image {mm_hash}")
    return identifier


def identifier_key(fingerprint: str, identifier: str, *, prefix: str = "encode") -> str | None:
    """The store key that ``identifier`` names, or None for one that names no stored image (an
    ``e:`` identifier, anything malformed). vLLM's own identifier for an item that has no ``uuid``
    is a 64-hex digest too: its key holds nothing (vLLM hashes a tagged, length-framed stream, and
    no image file that the server accepts begins like one), so it is a miss."""
    _check_hex("fingerprint", fingerprint)
    _check_prefix(prefix)
    if not isinstance(identifier, str) or _STORED_IDENTIFIER.fullmatch(identifier) is None:
        return None
    return f"{prefix}:{KEY_VERSION}:{fingerprint}:{identifier}"


def embeds_identifier(part_type: str, payload: object) -> str:
    """The identifier of a client's embeddings part: ``e:`` + BLAKE3 (key-derivation mode) of the
    part's type and payload exactly as forwarded, in canonical JSON (injective on JSON values: two
    parts share an identifier only when vLLM receives the same bytes for them)."""
    canonical = json.dumps([part_type, payload], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = blake3(canonical.encode("utf-8", "surrogatepass"), derive_key_context=_EMBEDS_CONTEXT)
    return "e:" + digest.hexdigest()
