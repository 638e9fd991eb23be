"""The value stored in the shared tier: one safetensors blob per embedding (DESIGN section 4).

Layout: tensor ``embedding`` (the raw little-endian bytes, dtype and shape in the safetensors
header) and ``__metadata__`` of str -> str:

    format       "encode-server/embedding/v1" (VALUE_FORMAT)
    fingerprint  the model fingerprint that produced it
    mm_hash      BLAKE3 of the image file
    dtype        "float32" | "bfloat16" | "float16"
    shape        JSON list, e.g. "[99,128]"
    meta         JSON object, e.g. '{"image_grid_thw":[1,18,22]}'

Any program with a safetensors reader can read it (the client's store reader does, without this
package). A shared store may hold anything (a truncated write, another model's value under a
reused prefix, a bug): :func:`decode_value` returns an :class:`Embedding` only when every field
agrees with what the reader expects, and otherwise raises :class:`CorruptValue`. It never serves a
value that is only almost right.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from encode_server.core.types import Embedding, EncodedTensor
from encode_server.core.wire import WireFormatError, WireTensor, dump_safetensors, load_safetensors

__all__ = ["TENSOR_NAME", "VALUE_FORMAT", "CorruptValue", "ValueSpec", "decode_value", "encode_value"]

VALUE_FORMAT = "encode-server/embedding/v1"
TENSOR_NAME = "embedding"
_FIELDS = frozenset({"format", "fingerprint", "mm_hash", "dtype", "shape", "meta"})


class CorruptValue(ValueError):
    """A stored value that must not be served; the message says which check failed."""


@dataclass(frozen=True)
class ValueSpec:
    """What every value read by one server must match: its fingerprint, dtype and last dim."""

    fingerprint: str
    dtype: str
    hidden_size: int


def encode_value(fingerprint: str, mm_hash: str, value: Embedding) -> bytes:
    t = value.tensor
    metadata = {
        "format": VALUE_FORMAT,
        "fingerprint": fingerprint,
        "mm_hash": mm_hash,
        "dtype": t.dtype,
        "shape": json.dumps(list(t.shape), separators=(",", ":")),
        "meta": json.dumps(value.meta, separators=(",", ":"), sort_keys=True),
    }
    return dump_safetensors([WireTensor(TENSOR_NAME, t.dtype, t.shape, t.data)], metadata)


def decode_value(blob: bytes, spec: ValueSpec, mm_hash: str) -> Embedding:
    """Parse ``blob`` and check it against ``spec`` and the key's ``mm_hash``, or raise."""
    try:
        tensors, metadata = load_safetensors(blob)
    except WireFormatError as exc:
        raise CorruptValue(f"not a safetensors value: {exc}") from None
    if set(metadata) != _FIELDS:
        raise CorruptValue(f"metadata fields {sorted(metadata)}, expected {sorted(_FIELDS)}")
    if metadata["format"] != VALUE_FORMAT:
        raise CorruptValue(f"format {metadata['format']!r}, expected {VALUE_FORMAT!r}")
    if metadata["fingerprint"] != spec.fingerprint:
        raise CorruptValue(f"fingerprint {metadata['fingerprint'][:16]}..., not this model's")
    if metadata["mm_hash"] != mm_hash:
        raise CorruptValue(f"mm_hash {metadata['mm_hash'][:16]}... under the key of {mm_hash[:16]}...")
    if set(tensors) != {TENSOR_NAME}:
        raise CorruptValue(f"tensors {sorted(tensors)}, expected [{TENSOR_NAME!r}]")
    tensor = tensors[TENSOR_NAME]
    try:
        shape = json.loads(metadata["shape"])
        meta = json.loads(metadata["meta"])
    except (ValueError, RecursionError) as exc:  # deep nesting is not a ValueError
        raise CorruptValue(f"metadata shape or meta is not JSON: {exc}") from None
    if tensor.dtype != spec.dtype or metadata["dtype"] != spec.dtype:
        raise CorruptValue(f"dtype {tensor.dtype}/{metadata['dtype']}, expected {spec.dtype}")
    if shape != list(tensor.shape):
        raise CorruptValue(f"metadata shape {shape} differs from the tensor's {list(tensor.shape)}")
    if len(tensor.shape) != 2 or tensor.shape[0] < 1 or tensor.shape[1] != spec.hidden_size:
        raise CorruptValue(f"shape {list(tensor.shape)}, expected [N >= 1, {spec.hidden_size}]")
    if not isinstance(meta, dict):
        raise CorruptValue(f"meta must be a JSON object, got {type(meta).__name__}")
    return Embedding(EncodedTensor(tensor.data, tensor.shape, tensor.dtype), meta)
