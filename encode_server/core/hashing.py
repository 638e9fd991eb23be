"""Identity of images, models and cache entries (docs/cache.md).

Three digests, all full 256-bit BLAKE3 in lowercase hex (64 characters), never truncated:

- ``mm_hash``: of the exact bytes of an image file, so any client computes it without decoding the
  image (``b3sum file`` prints the same).
- ``fingerprint``: of everything besides the image that changes the embedding, serialised by
  :func:`frame` so that distinct inputs can never serialise alike.
- the tenant part of a cache key: of the tenant id, so that no tenant id can forge another's key.

The cache key joins them: ``{prefix}:v1:{fingerprint}:{mm_hash}`` for an image, with
``:t:{tenant_digest}`` after the fingerprint under tenant isolation, ``:p:{settings_digest}`` after
that for an item preprocessed with per-request settings other than the server's defaults
(``core/settings.py``), and ``:{modality}`` before the ``mm_hash`` for any other modality
(``...:video:{mm_hash}``), so that one file's bytes sent as a video never address the entry they
have as an image, nor one preprocessed otherwise. Read from the right, a key is unambiguous: the
last segment is the ``mm_hash``; the one before it is a modality's name or 64 hex digits (a
settings digest, a tenant digest or the fingerprint), never both; the segment two before the
``mm_hash`` (or the modality) is ``p`` exactly when settings are present, and the segment two
before that digest (or, without settings, the same place) is ``t`` exactly when a tenant is present
(a fingerprint is 64 hex characters, never ``t`` or ``p``; the version segment ``v1`` sits between
the prefix and the fingerprint, so a prefix ending in ``:t`` or ``:p`` is never read as a marker).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import blake3

from encode_server.core.errors import BadInput
from encode_server.core.types import IMAGE, MODALITIES

__all__ = [
    "FINGERPRINT_VERSION",
    "KEY_VERSION",
    "CacheKey",
    "cache_key",
    "fingerprint",
    "frame",
    "is_mm_hash",
    "mm_hash",
    "parse_mm_hash",
    "tenant_digest",
]

KEY_VERSION = "v1"
"""Version segment of every cache key; bump it when the key layout or the value format changes."""

FINGERPRINT_VERSION = "encode-server/fingerprint/v1"
"""Domain tag hashed ahead of the fingerprint fields; bump it when :func:`frame` changes."""

_TENANT_DOMAIN = "encode-server/tenant/v1"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_DEPTH = 64

# One tag byte per kind of value. Tags are distinct, so values of different kinds never frame alike.
_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _FLOAT, _STR, _BYTES, _LIST, _DICT = b"i", b"f", b"s", b"b", b"l", b"d"


def mm_hash(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex BLAKE3-256 of ``data`` exactly as given (equal to ``b3sum``)."""
    return blake3.blake3(data).hexdigest()


def is_mm_hash(s: str) -> bool:
    """Whether ``s`` is exactly 64 hex digits (either case); no whitespace, no ``0x``."""
    return isinstance(s, str) and _HEX64.fullmatch(s) is not None


def parse_mm_hash(s: object) -> str:
    """Validate a client-supplied hash and return its canonical (lowercase) form.

    Raises ``BadInput`` with type ``invalid_hash``; the caller attributes it to an item index.
    """
    if not isinstance(s, str):
        raise BadInput(f"hash must be a string of 64 hex digits, got {type(s).__name__}", type="invalid_hash")
    if _HEX64.fullmatch(s) is None:
        shown = s if len(s) <= 80 else s[:77] + "..."
        raise BadInput(
            f"hash must be exactly 64 hex digits (a full BLAKE3-256 digest), got {shown!r} ({len(s)} characters)",
            type="invalid_hash",
        )
    return s.lower()


def frame(*fields: object) -> bytes:
    """Serialise ``fields`` so that distinct inputs never give the same bytes.

    Every value is a one-byte type tag followed by its payload; variable-length payloads carry an
    8-byte little-endian length (or item count) first. The code is prefix-free, so it decodes
    uniquely, which makes it injective:

    - ``None`` -> ``N``; ``True`` -> ``T``; ``False`` -> ``F`` (so ``True`` never frames as ``1``);
    - ``int`` -> ``i`` + len + minimal big-endian two's complement;
    - ``float`` -> ``f`` + IEEE-754 binary64 big-endian (``0.0`` and ``-0.0`` differ);
    - ``str`` -> ``s`` + len + UTF-8 (lone surrogates passed through, so every ``str`` encodes);
    - ``bytes``/``bytearray``/``memoryview`` -> ``b`` + len + bytes;
    - ``list``/``tuple`` -> ``l`` + count + each item framed (a tuple frames as the equal list, so
      a config read back from JSON fingerprints the same as the one built in code);
    - ``Mapping`` with ``str`` keys -> ``d`` + count + (key, value) pairs in sorted key order.

    The fields themselves are framed as one list, so ``frame(a, b)`` is never ``frame(a) + ...``.
    Any other type is a ``TypeError``: a silent ``repr`` fallback could make two configs collide.
    """
    out = bytearray()
    _encode(list(fields), out, 0)
    return bytes(out)


def _length(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _encode(value: object, out: bytearray, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"cannot frame values nested deeper than {_MAX_DEPTH} levels")
    # bool before int: bool is a subclass of int.
    if value is None:
        out += _NONE
    elif value is True:
        out += _TRUE
    elif value is False:
        out += _FALSE
    elif isinstance(value, int):
        payload = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big", signed=True)
        out += _INT + _length(len(payload)) + payload
    elif isinstance(value, float):
        out += _FLOAT + struct.pack(">d", value)
    elif isinstance(value, str):
        payload = value.encode("utf-8", "surrogatepass")
        out += _STR + _length(len(payload)) + payload
    elif isinstance(value, (bytes, bytearray, memoryview)):
        payload = bytes(value)
        out += _BYTES + _length(len(payload)) + payload
    elif isinstance(value, (list, tuple)):
        out += _LIST + _length(len(value))
        for item in value:
            _encode(item, out, depth + 1)
    elif isinstance(value, Mapping):
        keys = list(value.keys())
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"cannot frame a mapping with a {type(key).__name__} key; keys must be str")
        out += _DICT + _length(len(keys))
        for key in sorted(keys):
            _encode(key, out, depth + 1)
            _encode(value[key], out, depth + 1)
    else:
        raise TypeError(f"cannot frame a value of type {type(value).__name__}")


def fingerprint(fields: Mapping[str, object]) -> str:
    """Hex BLAKE3-256 over :data:`FINGERPRINT_VERSION` and the framed ``fields``.

    ``fields`` holds everything besides the image that changes the embedding: model id, revision,
    weights digest, dtype, preprocessing config, output kind, model kind. Key order does not matter;
    every value must be framable (see :func:`frame`). NaN is refused: it has many bit patterns, so
    one config could get several fingerprints.
    """
    if not isinstance(fields, Mapping):
        raise TypeError(f"fingerprint fields must be a mapping, got {type(fields).__name__}")
    framed = frame(FINGERPRINT_VERSION, fields)  # first: it bounds the depth _reject_nan walks
    _reject_nan(fields, "fields")
    return blake3.blake3(framed).hexdigest()


def _reject_nan(value: object, where: str) -> None:
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"fingerprint field {where} is NaN")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _reject_nan(item, f"{where}[{i}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _reject_nan(item, f"{where}[{key!r}]")


def tenant_digest(tenant: str) -> str:
    """Hex BLAKE3-256 of a tenant id, domain-separated from image and fingerprint digests.

    A digest rather than the raw id: a tenant id containing ``:`` cannot forge another tenant's
    key, the segment has a fixed length, and tenant names do not show in the store's key listing.
    """
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string (pass None for no tenant isolation)")
    return blake3.blake3(frame(_TENANT_DOMAIN, tenant)).hexdigest()


@dataclass(frozen=True, eq=False)
class CacheKey:
    """The address of one embedding in every tier, and in the single-flight table.

    Invariants (checked on construction): ``fingerprint`` and ``mm_hash`` are 64 lowercase hex
    digits (use :func:`parse_mm_hash` on client input: an uppercase hash would silently address a
    different key); ``prefix`` is non-empty printable text without whitespace (operator config; it
    may contain ``:``, as in ``prod:encode``); ``tenant``, when set, is a non-empty tenant id.
    ``modality`` is one of ``MODALITIES``; ``settings``, when set, is the 64-hex digest of the
    item's effective processor settings (``core.settings.digest``; None: the server's defaults).
    ``str(key)`` is the store key, computed once: ``{prefix}:v1:{fingerprint}:{identifier}``
    (module docstring), where ``identifier`` is what the EPD path hands vLLM as the item's
    ``uuid``: ``{mm_hash}`` for an image, ``t:{tenant_digest}:`` before it with a tenant, then
    ``p:{settings}:`` with settings, ``{modality}:`` before the ``mm_hash`` for a video. An image's key is
    what it was before modalities were keyed. Two keys are equal exactly when their store keys are,
    so a tier never splits a string apart again.
    """

    fingerprint: str
    mm_hash: str
    prefix: str = "encode"
    tenant: str | None = None
    modality: str = IMAGE
    settings: str | None = None
    text: str = field(init=False, repr=False)
    identifier: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fingerprint, mm_hash, prefix, tenant = self.fingerprint, self.mm_hash, self.prefix, self.tenant
        modality = self.modality
        if not isinstance(fingerprint, str) or _LOWER_HEX64.fullmatch(fingerprint) is None:
            raise ValueError(f"fingerprint must be 64 lowercase hex digits, got {fingerprint!r}")
        if not isinstance(mm_hash, str) or _LOWER_HEX64.fullmatch(mm_hash) is None:
            raise ValueError(f"mm_hash must be 64 lowercase hex digits (see parse_mm_hash), got {mm_hash!r}")
        if not isinstance(prefix, str) or not prefix or not prefix.isprintable() or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty printable string without whitespace, got {prefix!r}")
        if modality not in MODALITIES:
            raise ValueError(f"modality must be one of {', '.join(MODALITIES)}, got {modality!r}")
        identifier = mm_hash if modality == IMAGE else f"{modality}:{mm_hash}"
        if self.settings is not None:
            if not isinstance(self.settings, str) or _LOWER_HEX64.fullmatch(self.settings) is None:
                raise ValueError(f"settings must be a digest of 64 lowercase hex digits, got {self.settings!r}")
            identifier = f"p:{self.settings}:{identifier}"
        if tenant is not None:
            identifier = f"t:{tenant_digest(tenant)}:{identifier}"
        object.__setattr__(self, "identifier", identifier)
        object.__setattr__(self, "text", f"{prefix}:{KEY_VERSION}:{fingerprint}:{identifier}")

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def cache_key(
    fingerprint: str,
    mm_hash: str,
    *,
    prefix: str = "encode",
    tenant: str | None = None,
    modality: str = IMAGE,
    settings: str | None = None,
) -> str:
    """The store key of one embedding: ``str(CacheKey(...))`` (see :class:`CacheKey`)."""
    return CacheKey(fingerprint, mm_hash, prefix, tenant, modality, settings).text
