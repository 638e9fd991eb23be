"""The safetensors wire format, as the server names it: a re-export of the one strict codec,
:mod:`encode_client.safetensors`, which the server and the client share (the server depends on
the client package, never the reverse)."""

from encode_client.safetensors import (
    DTYPES,
    MAX_HEADER_BYTES,
    DType,
    SafetensorsError,
    WireFormatError,
    WireTensor,
    bf16_to_float32,
    dump_safetensors,
    from_numpy,
    load_safetensors,
    safetensors_parts,
    to_numpy,
)

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "DType",
    "SafetensorsError",
    "WireFormatError",
    "WireTensor",
    "bf16_to_float32",
    "dump_safetensors",
    "from_numpy",
    "load_safetensors",
    "safetensors_parts",
    "to_numpy",
]
