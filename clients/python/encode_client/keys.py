"""Store keys, and the identifiers the EPD path gives vLLM for them, built from their parts.

A prefill worker's EC connector is asked for an item by an identifier alone: it rebuilds the key
the server wrote, ``{prefix}:v1:{fingerprint}:{identifier}`` (DESIGN.md section 1; docs/cache.md).
The layout is the server's; a test checks this copy against it, because the client never imports
the server.

Identifiers (what vLLM sees as an item's ``uuid``; docs/vllm.md, "Threat model"): the tail of the
store key after the fingerprint, so that the key is always ``{prefix}:v1:{fingerprint}:{identifier}``:

- ``{mm_hash}``: an image stored without a tenant;
- ``t:{tenant_digest}:{mm_hash}``: an image stored for a tenant. Two tenants sending one image get
  two identifiers, so they never share an entry of vLLM's encoder, processor or prefix cache, and
  the connector reads each from its own tenant's key;
- ``video:{mm_hash}`` (``t:{tenant_digest}:video:{mm_hash}`` for a tenant): a video. One file's
  bytes sent as a video are another entry than as an image, in the store and in vLLM's caches;
  ``audio:{mm_hash}`` likewise an audio file;
- ``p:{settings_digest}:`` ahead of the modality (after a tenant's part): an item preprocessed with
  per-request settings (``mm_processor_kwargs``) other than the server's defaults, named by the
  server's digest of the effective settings. One image under two settings is two entries, in the
  store and in vLLM's caches; under the defaults it has the identifier it always had;
- ``e:{digest}``: a client's own embedding that a trusted caller may send (``--trust-client-embeds``),
  named by the content hash of its payload. It is never a store key: the connector never looks it
  up, and it can never equal an image's identifier (another shape, and BLAKE3 in its key-derivation
  mode, whose outputs are apart from every plain BLAKE3 digest such as an ``mm_hash``).

Every identifier is computed by the proxy or the server from bytes; none is ever a client's.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from blake3 import blake3

__all__ = [
    "EC_PARAMS_KEY",
    "KEY_VERSION",
    "StoredIdentifier",
    "embeds_identifier",
    "epd_identifier",
    "identifier_key",
    "own_identifier",
    "parse_identifier",
    "store_key",
    "tenant_digest",
]

KEY_VERSION = "v1"
# The EPD path's entry in a request's ``ec_transfer_params``: ``{"items": {modality: [identifier, ...]}}``,
# each modality's identifiers in vLLM's item order, for a request whose uuids vLLM hashes with its
# ``mm_processor_kwargs`` (``use_audio_in_video``); read by ``encode_client.vllm_connector``.
EC_PARAMS_KEY = "encode_server"
IMAGE = "image"
# The modalities a key names by a segment of their own (an image's key has none: as it always was).
_KEYED_MODALITIES = ("video", "audio")
_TENANT_DOMAIN = "encode-server/tenant/v1"
# BLAKE3's derive_key mode: a context string, globally unique and fixed (the BLAKE3 paper's rule).
_EMBEDS_CONTEXT = "encode-server 2025-12 EPD client embeddings identifier v1"
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")
_STORED_IDENTIFIER = re.compile(
    r"(?:t:(?P<tenant>[0-9a-f]{64}):)?(?:p:(?P<settings>[0-9a-f]{64}):)?(?:(?P<modality>video|audio):)?"
    r"(?P<mm_hash>[0-9a-f]{64})"
)


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


def own_identifier(
    mm_hash: str, modality: str = IMAGE, tenant_digest: str | None = None, settings: str | None = None
) -> str:
    """The identifier of ``mm_hash`` as a ``modality`` item (with a tenant's digest, a tenant's;
    with a settings digest, preprocessed under those settings)."""
    tail = mm_hash if modality == IMAGE else f"{modality}:{mm_hash}"
    if settings is not None:
        tail = f"p:{settings}:{tail}"
    return tail if tenant_digest is None else f"t:{tenant_digest}:{tail}"


def store_key(
    fingerprint: str,
    mm_hash: str,
    *,
    prefix: str = "encode",
    tenant: str | None = None,
    modality: str = IMAGE,
    settings: str | None = None,
) -> str:
    """The Redis key under which the server stores ``mm_hash``'s embedding, as a ``modality`` item,
    for ``fingerprint`` (``settings``: the digest of non-default processor settings)."""
    _check_hex("fingerprint", fingerprint)
    _check_hex("mm_hash", mm_hash)
    if settings is not None:
        _check_hex("settings", settings)
    _check_prefix(prefix)
    if modality != IMAGE and modality not in _KEYED_MODALITIES:
        raise ValueError(f"modality must be one of {', '.join((IMAGE, *_KEYED_MODALITIES))}, got {modality!r}")
    digest = tenant_digest(tenant) if tenant is not None else None
    return f"{prefix}:{KEY_VERSION}:{fingerprint}:{own_identifier(mm_hash, modality, digest, settings)}"


class StoredIdentifier(NamedTuple):
    """The parts of a stored item's identifier."""

    tenant: str | None  # the tenant's digest (the key's segment), None without tenant isolation
    modality: str
    mm_hash: str
    settings: str | None = None  # the settings digest, None under the server's defaults


def parse_identifier(identifier: object) -> StoredIdentifier | None:
    """The parts of an identifier that names a stored item, or None for any other (an ``e:``
    identifier, vLLM's own digest-shaped one is a plain image's and parses as such)."""
    match = _STORED_IDENTIFIER.fullmatch(identifier) if isinstance(identifier, str) else None
    if match is None:
        return None
    return StoredIdentifier(match["tenant"], match["modality"] or IMAGE, match["mm_hash"], match["settings"])


def epd_identifier(key: str, mm_hash: str, modality: str = IMAGE) -> str:
    """The identifier vLLM gets for the ``modality`` item ``mm_hash`` that the server stored under ``key``.

    ``key`` is the hand-off's answer, ``{prefix}:v1:{fingerprint}:{identifier}``, read from the
    right (the server's rule: the last segment is the ``mm_hash``; before it, a modality's name for
    any item but an image; two before those, ``p`` exactly when settings are present; two before
    those (or the same place without settings), ``t`` exactly when a tenant is present). It must be
    a well-formed key of exactly this item, as this modality. Raises ``ValueError`` otherwise."""
    _check_hex("mm_hash", mm_hash)
    parts = key.split(":") if isinstance(key, str) else []
    keyed = parts[-2] if len(parts) >= 5 and parts[-2] in _KEYED_MODALITIES else IMAGE
    if keyed != modality:
        raise ValueError(f"{key!r} is the key of {keyed} {mm_hash}, not of a {modality}")
    rest = len(parts) - (2 if modality != IMAGE else 1)  # the segments ahead of the modality/mm_hash
    settings = parts[rest - 1] if rest >= 5 and parts[rest - 2] == "p" else None
    rest -= 2 if settings is not None else 0
    digest = parts[rest - 1] if rest >= 5 and parts[rest - 2] == "t" else None
    identifier = own_identifier(mm_hash, modality, digest, settings)
    head, _, fingerprint = key[: -len(identifier) - 1].rpartition(":") if parts else ("", "", "")
    prefix, _, version = head.rpartition(":")
    if (
        not key.endswith(":" + identifier)
        or _STORED_IDENTIFIER.fullmatch(identifier) is None
        or _LOWER_HEX64.fullmatch(fingerprint) is None
        or version != KEY_VERSION
        or not prefix
    ):
        raise ValueError(f"{key!r} is not a store key of item {mm_hash}")
    return identifier


def identifier_key(fingerprint: str, identifier: str, *, prefix: str = "encode") -> str | None:
    """The store key that ``identifier`` names, or None for one that names no stored item (an
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
