"""The value stored in the shared tier: one safetensors blob per embedding (docs/cache.md).

Layout: tensor ``embedding`` (the raw little-endian bytes, dtype and shape in the safetensors
header) and ``__metadata__`` of str -> str:

    format       "encode-server/embedding/v1" (VALUE_FORMAT)
    fingerprint  the model fingerprint that produced it
    mm_hash      BLAKE3 of the image file
    dtype        "float32" | "bfloat16" | "float16"
    shape        JSON list, e.g. "[99,128]"
    meta         JSON object: what the family's processor says of the item (its grid, ...)

The format is written and validated by :mod:`encode_client.store` (``dump_value``,
``parse_value``), so a prefill worker reading Redis and this server accept exactly the same
values. On top, the server checks what only it knows (:class:`ValueSpec`: this model's dtype and
hidden size). A shared store may hold anything (a truncated write, another model's value under a
reused prefix, a bug): :func:`decode_value` returns an :class:`Embedding` only when every field
agrees, and otherwise raises :class:`CorruptValue`. It never serves a value that is only almost
right.
"""

from __future__ import annotations

from dataclasses import dataclass

from encode_client.safetensors import WireTensor
from encode_client.store import VALUE_FORMAT, CorruptValue, dump_value, read_value

from encode_server.core.types import Embedding, EncodedTensor

__all__ = ["VALUE_FORMAT", "CorruptValue", "ValueSpec", "decode_value", "encode_value"]


@dataclass(frozen=True)
class ValueSpec:
    """What every value read by one server must match: its fingerprint, dtype and last dim
    (``hidden_size``, or one of ``widths``: a modality's own, ``EncoderInfo.widths``)."""

    fingerprint: str
    dtype: str
    hidden_size: int
    widths: frozenset[int] = frozenset()


def encode_value(fingerprint: str, mm_hash: str, value: Embedding) -> bytes:
    t = value.tensor
    return dump_value(fingerprint, mm_hash, WireTensor("embedding", t.dtype, t.shape, t.data), value.meta)


def decode_value(blob: bytes, spec: ValueSpec, mm_hash: str) -> Embedding:
    """Parse ``blob`` read under the key of ``mm_hash`` and check it against ``spec``, or raise."""
    stored = read_value(blob, where=f"value of {mm_hash[:16]}...")
    if stored.fingerprint != spec.fingerprint:
        raise CorruptValue(f"fingerprint {stored.fingerprint[:16]}..., not this model's")
    if stored.mm_hash != mm_hash:
        raise CorruptValue(f"mm_hash {stored.mm_hash[:16]}... under the key of {mm_hash[:16]}...")
    if stored.dtype != spec.dtype:
        raise CorruptValue(f"dtype {stored.dtype}, expected {spec.dtype}")
    if stored.shape[1] != spec.hidden_size and stored.shape[1] not in spec.widths:
        widths = " or ".join(str(w) for w in sorted({spec.hidden_size, *spec.widths}))
        raise CorruptValue(f"shape {list(stored.shape)}, expected [N >= 1, {widths}]")
    return Embedding(EncodedTensor(stored.data, stored.shape, stored.dtype), stored.meta)
