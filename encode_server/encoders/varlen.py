"""One attention call per layer for variable-length towers, and no host sync inside a forward.

A dynamic-resolution tower (Qwen2-VL and its descendants, GLM-4.1V, the Omni thinkers' towers)
attends within each image, or within each window of an image, over a batch packed into one
sequence and cut by ``cu_seqlens``. transformers runs that as one attention call per segment
(its ``sdpa`` path splits by ``cu_seqlens.tolist()`` in every block): thousands of small calls
per pass, and on a GPU a host sync in every block. vLLM and SGLang run one variable-length call
per layer instead. So does this module, through transformers' own switch: an attention
implementation whose name contains "flash" gets the whole packed sequence and its ``cu_seqlens``
in one call (``ATTENTION``, registered in transformers' ``AttentionInterface``). What it does:

- On CUDA in half precision: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's own FlashAttention
  2 kernel: one launch per layer, sizes passed as ints).
- Elsewhere (the CPU; float32 on CUDA): the exact path, one SDPA call per distinct segment length,
  over every segment of that length as one 4-D batch (``Layout``). On the CPU that is bit for bit
  the per-segment loop (transformers' ``sdpa`` path, and vLLM's CPU encoder attention), so every
  row parity with vLLM holds as it was; a pass of equal images takes one call per full-attention
  layer and one per window size per windowed layer. Padding segments into one masked call was
  tried and rejected: it rounds differently from the loop (1e-7 in float32, flips in bfloat16),
  and was no faster here (docs/benchmarks.md).

Everything that depends only on the grids (rotary positions, window order, ``cu_seqlens``, their
maxima, the padding layout) is made on the host before the pass (``GridPlan``), per image and
cached, and handed to transformers' tower through its precomputed-input keywords
(``transformers.vision_utils``: it pops them instead of computing them), so nothing inside the
forward asks the device for a number. The grouping travels beside the pass in a context
variable (``segments``), keyed by the ``cu_seqlens`` tensor it belongs to.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "GridPlan", "Layout", "PassInputs", "attend", "cu_seqlens_on", "kernel_takes", "layout_of",
           "segments", "use_varlen"]

# transformers takes its one-call (packed) path for an implementation whose name contains "flash".
ATTENTION = "encode_server_flash_varlen"

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class Layout:
    """How the exact path lays one ``cu_seqlens`` (``bounds``) out: the segments grouped by length,
    each group one SDPA batch ``[segments, heads, length, head_dim]``. Worked out on first use, so
    a pass the ``varlen_attn`` kernel runs never pays for it.

    ``groups``: per group, (the packed rows it gathers, segment after segment; its segment count;
    their length). ``scatter``: for each packed row, its place in the groups' outputs laid end to
    end; None when that is the identity (one group, in order), which costs no op.

    A batch of equal-length segments gives, on the CPU, each segment's rows bit for bit as its own
    call does (the kernel's work per row does not depend on the batch), so the path is the
    per-segment loop's (transformers' and vLLM's CPU path) in one call per distinct length.
    """

    bounds: np.ndarray
    _device: dict[torch.device, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, cu: Sequence[int] | np.ndarray) -> Layout:
        return cls(np.asarray(cu, dtype=np.int64))

    @functools.cached_property
    def _grouped(self) -> tuple[tuple[tuple[np.ndarray, int, int], ...], np.ndarray | None]:
        bounds = self.bounds
        starts, lengths = bounds[:-1] - bounds[0], np.diff(bounds)
        total = int(bounds[-1] - bounds[0])
        scatter = np.empty(total, dtype=np.int64)
        groups: list[tuple[np.ndarray, int, int]] = []
        base = 0
        for length in sorted({int(n) for n in lengths if n > 0}, reverse=True):
            members = np.flatnonzero(lengths == length)
            gather = (starts[members][:, None] + np.arange(length)[None, :]).reshape(-1)
            scatter[gather] = base + np.arange(gather.size)
            groups.append((gather, len(members), length))
            base += gather.size
        identity = len(groups) == 1 and bool((scatter == np.arange(total)).all())
        return tuple(groups), None if identity else scatter

    @property
    def groups(self) -> tuple[tuple[np.ndarray, int, int], ...]:
        return self._grouped[0]

    @property
    def scatter(self) -> np.ndarray | None:
        return self._grouped[1]

    @property
    def calls(self) -> int:
        return len(self.groups)

    def on(self, device: torch.device) -> tuple[list[tuple[torch.Tensor | None, int, int]], torch.Tensor | None]:
        """The index tensors on ``device`` (made once per device)."""
        if device not in self._device:
            if self.scatter is None:
                self._device[device] = ([(None, count, length) for _, count, length in self.groups], None)
            else:
                def put(a: np.ndarray) -> torch.Tensor:
                    return torch.from_numpy(a).to(device, non_blocking=True)

                self._device[device] = ([(put(gather), count, length) for gather, count, length in self.groups],
                                        put(self.scatter))
        return self._device[device]


_LAYOUTS: contextvars.ContextVar[Mapping[int, Layout] | None] = contextvars.ContextVar("varlen_layouts", default=None)


@contextlib.contextmanager
def segments(layouts: Mapping[int, Layout]) -> Iterator[None]:
    """Within it, the exact path finds each ``cu_seqlens`` tensor's layout by the tensor's id."""
    token = _LAYOUTS.set(layouts)
    try:
        yield
    finally:
        _LAYOUTS.reset(token)


def cu_seqlens_on(bounds: np.ndarray, device: torch.device) -> tuple[torch.Tensor, dict[int, Layout]]:
    """Cumulative segment bounds as the kernels take them (int32, on ``device``) and their layout,
    keyed for ``segments``."""
    tensor = torch.from_numpy(np.asarray(bounds).astype(np.int32)).to(device, non_blocking=True)
    return tensor, {id(tensor): Layout.of(bounds)}


def layout_of(cu_seqlens: torch.Tensor) -> Layout:
    """The layout made before the pass; without one (a caller that made no plan), read from the
    tensor, which on a device is a host sync."""
    known = _LAYOUTS.get()
    if known is not None and (layout := known.get(id(cu_seqlens))) is not None:
        return layout
    return Layout.of(cu_seqlens.numpy() if cu_seqlens.device.type == "cpu" else cu_seqlens.tolist())


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., torch.Tensor] | None, bool]:
    """PyTorch's ``varlen_attn`` (2.10+) and whether it takes ``scale`` (its keywords moved
    between releases; the seven positional arguments did not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return cast(Callable[..., torch.Tensor], varlen_attn), "scale" in inspect.signature(varlen_attn).parameters


def kernel_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``attend`` runs the ``varlen_attn`` kernel for such inputs (CUDA, or the meta device
    that counts its path; half precision; a head size its FlashAttention build takes)."""
    kernel, _ = _varlen_kernel()
    return (kernel is not None and device.type in ("cuda", "meta") and dtype in (torch.float16, torch.bfloat16)
            and head_dim <= 256 and head_dim % 8 == 0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None,
           scale: float | None = None) -> torch.Tensor:
    """Attention within each segment of packed ``[tokens, heads, head_dim]`` inputs: one
    ``varlen_attn`` call where the kernel takes them, else one SDPA call per distinct segment
    length (``Layout``)."""
    head_dim = q.shape[-1]
    if max_seqlen is not None and kernel_takes(q.device, q.dtype, head_dim):
        kernel, takes_scale = _varlen_kernel()
        assert kernel is not None
        cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        if scale is None or takes_scale:
            extra = {} if scale is None else {"scale": scale}
            return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, **extra)
        return kernel(q * (scale * math.sqrt(head_dim)), k, v, cu, cu, max_seqlen, max_seqlen)
    groups, scatter = layout_of(cu_seqlens).on(q.device)
    heads = q.shape[1]
    outs = []
    for gather, count, length in groups:
        picked = [t if gather is None else t.index_select(0, gather) for t in (q, k, v)]
        batch = [t.view(count, length, heads, head_dim).transpose(1, 2) for t in picked]
        out = F.scaled_dot_product_attention(batch[0], batch[1], batch[2], scale=scale)
        outs.append(out.transpose(1, 2).reshape(count * length, heads, head_dim))
    joined = outs[0] if len(outs) == 1 else torch.cat(outs)
    return joined if scatter is None else joined.index_select(0, scatter)


def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: ``[1, heads, tokens, head_dim]`` in,
    ``[1, tokens, heads, head_dim]`` out (what its flash path returns)."""
    if cu_seq_lens_q is None or attention_mask is not None or kwargs.get("is_causal"):
        raise NotImplementedError(f"{ATTENTION} serves packed, bidirectional vision attention only")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise NotImplementedError(f"{ATTENTION} serves self-attention only")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    return attend(q, k, v, cu_seq_lens_q, max_length_q, scaling).unsqueeze(0), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention_forward)


def use_varlen(module: torch.nn.Module) -> None:
    """Every attention of ``module`` (a transformers tower) through ``ATTENTION`` from now on.
    The config keeps its JSON (``_attn_implementation`` is not serialised), so the fingerprint
    does not move."""
    _register()
    configs = {id(m.config): m.config for m in module.modules() if getattr(m, "config", None) is not None}
    for config in configs.values():
        cast(Any, config)._attn_implementation_internal = ATTENTION


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


@dataclass(frozen=True)
class PassInputs:
    """A pass's precomputed keywords for the tower, on its device, and the layouts of its
    ``cu_seqlens`` tensors (for ``segments``)."""

    kwargs: dict[str, Any]
    layouts: dict[int, Layout]


class GridPlan:
    """What a Qwen-style tower computes from its grids alone, made on the host before a pass.

    Each image's part comes from transformers' own helpers (``transformers.vision_utils``) run on
    its grid alone on the CPU, so it is what the tower would compute, and is cached by grid; a
    pass joins its images' parts (offsets added) into the tower's precomputed-input keywords.

    ``windows``: (window size, patch size) for a windowed tower (Qwen2.5-VL), else None.
    ``interpolation``: ``get_vision_interpolation_indices_and_weights``' settings for a tower with
    a learned position grid resampled to each image (Qwen3-VL), else None.
    """

    def __init__(self, merge_size: int, *, windows: tuple[int, int] | None = None,
                 interpolation: Mapping[str, Any] | None = None) -> None:
        self.merge_size = merge_size
        self.windows = windows
        self.interpolation = dict(interpolation) if interpolation else None
        self._item = functools.lru_cache(maxsize=1024)(self._make_item)
        try:
            import transformers.vision_utils  # noqa: F401  (transformers 5.x with precomputed inputs)
            self.supported = True
        except ImportError:
            self.supported = False

    def _make_item(self, grid: Grid) -> dict[str, np.ndarray]:
        from transformers import vision_utils as vu

        thw = torch.tensor([grid], dtype=torch.int64)
        item = {"position_ids": _host(vu.get_vision_position_ids(thw, self.merge_size))}
        if self.windows is not None:
            window_size, patch_size = self.windows
            index, cu = vu.get_vision_window_index(thw, spatial_merge_size=self.merge_size, window_size=window_size,
                                                   patch_size=patch_size)
            item["window_index"], item["cu_window_seqlens"] = _host(index), _host(cu).astype(np.int64)
        if self.interpolation is not None:
            indices, weights = vu.get_vision_interpolation_indices_and_weights(
                thw, spatial_merge_size=self.merge_size, **self.interpolation)
            item["interp_indices"], item["interp_weights"] = _host(indices), _host(weights)
        return item

    def host(self, grids: Sequence[Grid], *, budget: int | None = None,
             slots: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
        """A pass's keywords on the host: (arrays, cumulative bounds, maxima).

        ``budget``: pad the pass to that many patch rows (a CUDA graph's fixed shapes): the padding
        rows are one more segment of their own in every attention (and their own windows), at
        position 0 with no learned position, so no real row sees them; each bound array is then
        ``slots + 1`` long (the last bound repeated: empty segments), and the maxima are the
        budget, an upper bound the kernel takes as it takes the true one.
        """
        items = [self._item(tuple(int(x) for x in g)) for g in grids]
        frames = [h * w for t, h, w in grids for _ in range(t)]
        total = sum(frames)
        unit = self.merge_size**2
        pad = 0 if budget is None else budget - total
        if pad < 0 or pad % unit:
            raise ValueError(f"cannot pad {total} patch rows to {budget}")
        arrays: dict[str, np.ndarray] = {
            "position_ids": _padded(np.concatenate([i["position_ids"] for i in items]), pad)}
        bounds = {"cu_seqlens": np.concatenate([[0], np.cumsum(frames + ([pad] if pad else []))]).astype(np.int64)}
        maxima = {"max_seqlen": int(max([*frames, pad]))}
        if self.windows is not None:
            offsets = np.cumsum([0] + [t * h * w // unit for t, h, w in grids])
            index = np.concatenate([i["window_index"] + o for i, o in zip(items, offsets, strict=False)])
            arrays["window_index"] = np.concatenate([index, np.arange(total // unit, (total + pad) // unit)])
            patches = np.cumsum([0] + [t * h * w for t, h, w in grids])
            windows = np.concatenate([[0]] + [i["cu_window_seqlens"][1:] + p
                                              for i, p in zip(items, patches, strict=False)]
                                     + ([[total + pad]] if pad else []))
            bounds["cu_window_seqlens"] = windows
            maxima["max_window_seqlen"] = int(np.diff(windows).max())
        if self.interpolation is not None:
            arrays["interp_indices"] = _padded(np.concatenate([i["interp_indices"] for i in items]), pad)
            arrays["interp_weights"] = _padded(np.concatenate([i["interp_weights"] for i in items]), pad)
        if budget is not None:
            assert slots is not None
            for name, b in bounds.items():
                if len(b) > slots + 1:
                    raise ValueError(f"{len(b) - 1} segments in {name}: more than the {slots} slots")
                bounds[name] = np.concatenate([b, np.full(slots + 1 - len(b), b[-1])])
            maxima = dict.fromkeys(maxima, budget)
        return arrays, bounds, maxima

    def inputs(self, grids: Sequence[Grid], device: torch.device) -> PassInputs:
        """The tower's keywords for a pass over ``grids`` (in order), on ``device``."""
        if not self.supported:
            return PassInputs({}, {})
        arrays, bounds, maxima = self.host(grids)
        kwargs: dict[str, Any] = {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in arrays.items()}
        layouts: dict[int, Layout] = {}
        for name, b in bounds.items():
            kwargs[name], layout = cu_seqlens_on(b, device)
            layouts |= layout
        kwargs.update(maxima)
        return PassInputs(kwargs, layouts)


def _padded(rows: np.ndarray, pad: int) -> np.ndarray:
    """``rows`` with ``pad`` zero rows after them."""
    return rows if not pad else np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), dtype=rows.dtype)])
