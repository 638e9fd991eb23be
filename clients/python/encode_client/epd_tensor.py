"""A number or a 1-D list of numbers as the base64 tensor string vLLM's chat parser loads for an
embeddings part's key (``{"video_embeds": {"<a contract's tensor field>": "<this>"}}``), without torch.

vLLM 0.32's OpenAI server takes a JSON array in an embeddings dict only for the keys its model's
parser declares (``placeholder_metadata_fields``); a string value it decodes as base64 and loads
as a tensor (``VideoEmbeddingMediaIO.load_bytes`` and its image and audio twins): a NumPy ``.npy``
file (recognised by its magic, read with ``np.load``, which refuses pickles) or else ``torch.load(...,
weights_only=True)``. This writes the ``.npy`` form: it needs only numpy (the client stays
installable without torch) and no hand-built pickle. Only float32, float64 and int64 of finite
numbers, 0-D or 1-D, are written: anything else is refused, as nothing the contract names needs more.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["DTYPES", "tensor_string"]

DTYPES = ("float32", "float64", "int64")


def tensor_string(value: float | int | Sequence[float | int], dtype: str) -> str:
    """``value`` (a number: a 0-D tensor; a list of numbers: 1-D) as base64 ``.npy`` in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"a tensor string's dtype must be one of {DTYPES}, not {dtype!r}")
    numbers = value if isinstance(value, list | tuple) else [value]
    for n in numbers:
        if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
            raise ValueError(f"a tensor string holds finite numbers only, not {n!r}")
        if dtype == "int64" and not (isinstance(n, int) and -(2**63) <= n < 2**63):
            raise ValueError(f"an int64 tensor holds 64-bit integers only, not {n!r}")
    array = np.asarray(value, dtype=np.dtype(dtype).newbyteorder("<"))
    if array.ndim > 1:
        raise ValueError("a tensor string is 0-D or 1-D")
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
