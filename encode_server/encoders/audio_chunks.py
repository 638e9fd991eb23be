"""One attention call per layer for the Omni thinkers' chunked audio towers, and no host sync inside a
forward.

Qwen2.5-Omni's and Qwen3-Omni's audio towers (transformers' ``Qwen2_5OmniAudioEncoder`` and
``Qwen3OmniMoeAudioEncoder``) cut each item's log-mel frames into chunks of ``2 * n_window``
frames, convolve the chunks padded side by side, keep each chunk's own rows, and attend within each
chunk (Qwen2.5-Omni) or each ``n_window_infer`` window of an item's rows (Qwen3-Omni), packed and
cut by ``cu_seqlens``. Left to itself the tower reads that layout back from the device (the chunk
lengths' ``.tolist()``, their maximum's ``.item()``, a ``nonzero``, a tensor sized by a sum), and
its ``sdpa`` path makes one attention call per segment per layer.

All of it but the features depends only on the items' frame counts, which the host holds as ints.
So ``ChunkPlan`` computes it before the pass with the tower's own helpers (those of the module
transformers defines the tower in: ``chunk_and_pad_features``, ``get_valid_indices``,
``get_audio_cu_seqlens`` and, where there is one, ``get_pool_indices``), on CPU tensors, cached by
the pass's frame counts; it lays the padded chunks out on the host from the items' features; and
the tower pops all of it from its keywords instead of computing it (transformers' precomputed-input
pattern, as ``varlen.GridPlan`` feeds the vision towers). With the tower's attention switched to
``varlen.ATTENTION`` (``use_varlen``) a layer is one ``varlen_attn`` call on CUDA, and on the CPU
one SDPA call per distinct segment length, bit for bit the tower's per-segment loop.

A transformers whose helpers take no precomputed keywords (``supported`` false) gets the tower's
own inputs, and keeps its own attention.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .varlen import Layout, PassInputs

__all__ = ["ChunkPlan"]

# the tower's helpers, each popping its result from ``kwargs`` when the caller made it
_HELPERS = ("chunk_and_pad_features", "get_valid_indices", "get_audio_cu_seqlens")
_POOL = "get_pool_indices"  # Qwen2.5-Omni's stride-2 pooling after the layers
# what a helper may ask for: the pass's inputs and the tower's settings
_KNOWN = frozenset({"input_features", "feature_lens", "chunk_lengths", "n_window", "n_window_infer", "kwargs"})


@dataclass(frozen=True)
class _Host:
    """A pass's layout on the host: the index arrays the tower takes, its ``cu_seqlens``, their
    longest segment and layout, and the chunks' frame counts in pass order."""

    arrays: dict[str, np.ndarray]
    cu_seqlens: np.ndarray
    max_seqlen: int
    layout: Layout
    chunks: tuple[int, ...]


class ChunkPlan:
    """What a chunked audio tower computes from its items' frame counts, made on the host.

    Invariant: ``inputs(features)`` gives the tower, as keywords, exactly what its own forward
    would compute from ``torch.cat(features, -1)`` and the frame counts (each array made by the
    tower's own helper; the padded chunks laid out as ``chunk_and_pad_features`` lays them).
    """

    def __init__(self, tower: Any) -> None:
        self.helpers = sys.modules[type(tower).__module__]
        self.settings = {"n_window": int(tower.n_window)}
        if hasattr(tower, "n_window_infer"):
            self.settings["n_window_infer"] = int(tower.n_window_infer)
        self.chunk_frames = 2 * self.settings["n_window"]
        names = _HELPERS + ((_POOL,) if hasattr(self.helpers, _POOL) else ())
        self.supported = all(_takes_precomputed(getattr(self.helpers, name, None)) for name in names)
        self.pools = _POOL in names
        self._host = functools.lru_cache(maxsize=256)(self._make)

    def _call(self, name: str, values: dict[str, Any]) -> Any:
        helper = getattr(self.helpers, name)
        return helper(**{p: values[p] for p in inspect.signature(helper).parameters if p != "kwargs"})

    def _make(self, frames: tuple[int, ...]) -> _Host:
        """The tower's own computations for a pass of ``frames``, on CPU tensors (no device to wait
        for): only the frame counts matter, so the features are a zero row."""
        lengths = torch.tensor(frames, dtype=torch.long)
        values: dict[str, Any] = {**self.settings, "feature_lens": lengths,
                                  "input_features": torch.zeros(1, sum(frames))}
        _, chunk_lengths = self._call("chunk_and_pad_features", values)
        values["chunk_lengths"] = chunk_lengths
        arrays = {"chunk_lengths": chunk_lengths.numpy(),
                  "valid_indices": self._call("get_valid_indices", values).numpy()}
        if self.pools:
            arrays["pool_indices"] = self._call(_POOL, values).numpy()
        cu = self._call("get_audio_cu_seqlens", values).numpy()
        return _Host(arrays, cu, int(np.diff(cu).max()), Layout.of(cu), tuple(int(n) for n in arrays["chunk_lengths"]))

    def padded(self, features: Sequence[torch.Tensor], chunks: Sequence[int]) -> np.ndarray:
        """``[chunks, n_mels, longest chunk]``: each item's frames cut into chunks of
        ``chunk_frames`` (the last one shorter), zero-padded, in pass order."""
        out = np.zeros((len(chunks), features[0].shape[0], max(chunks)), dtype=features[0].numpy().dtype)
        row = 0
        for item in features:
            frames = item.numpy()
            for start in range(0, frames.shape[-1], self.chunk_frames):
                piece = frames[:, start:start + self.chunk_frames]
                if piece.shape[-1] != chunks[row]:
                    raise RuntimeError(f"chunk {row} has {piece.shape[-1]} frames, the tower's plan {chunks[row]}")
                out[row, :, :piece.shape[-1]] = piece
                row += 1
        return out

    def inputs(self, features: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> PassInputs:
        """The tower's keywords for a pass over ``features`` (each item's ``[n_mels, frames]``, on
        the host, in order), on ``device``, and the layout of its ``cu_seqlens``."""
        if not self.supported:
            frames = torch.tensor([f.shape[-1] for f in features])
            return PassInputs({"input_features": torch.cat(list(features), dim=-1).to(device, dtype=dtype),
                               "feature_lens": frames.to(device)}, {})
        host = self._host(tuple(int(f.shape[-1]) for f in features))

        def put(a: np.ndarray, **kw: Any) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True, **kw)

        kwargs: dict[str, Any] = {name: put(a) for name, a in host.arrays.items()}
        kwargs["padded_feature"] = put(self.padded(features, host.chunks), dtype=dtype)
        kwargs["cu_seqlens"] = cu = put(host.cu_seqlens)
        kwargs["max_seqlen"] = host.max_seqlen
        return PassInputs(kwargs, {id(cu): host.layout})


def _takes_precomputed(helper: Callable[..., Any] | None) -> bool:
    """Whether ``helper`` pops a precomputed result from ``kwargs`` and asks only for what a plan
    knows."""
    if helper is None:
        return False
    params = set(inspect.signature(helper).parameters)
    return "kwargs" in params and params <= _KNOWN
