"""``--dtype auto`` as vLLM 0.32 decides it, a pure rule over dtype names.

Why: the prefill worker computes with the embedding in its own dtype, and vLLM's own tower (the
answer EPD must equal) runs in that dtype too. An E that encodes in another dtype gives other
numbers, hence sometimes other tokens (measured on a bfloat16 checkpoint on the CPU: float32 on
the server, vLLM in bfloat16, 22 of 24 chats equal). So encode-server's ``auto`` is vLLM's
``auto`` (``vllm/config/model.py``: ``_resolve_auto_dtype`` and ``_get_and_verify_dtype``, for a
generating model; ``vllm/platforms/{cpu,cuda}.py``: ``supported_dtypes``):

1. the checkpoint's dtype: ``config.json``'s ``dtype`` (or ``torch_dtype``), else its text
   config's, vision config's or encoder config's, else the widest dtype of its safetensors
   weights, else float32;
2. the device's supported dtypes, in the platform's order of preference (CUDA with compute
   capability 8.0 or more and the x86/ARM CPUs: bfloat16, float16, float32; CUDA 6.x-7.x:
   float16, float32; POWER: bfloat16, float32, float16), without float16 for the model types vLLM
   refuses it for;
3. a float32 checkpoint takes the preferred (first) supported dtype; any other its own dtype when
   supported, else the preferred one; on POWER CPUs anything but bfloat16 becomes bfloat16.

The builtin model has no checkpoint and no vLLM loads it: its ``auto`` stays bfloat16 on CUDA,
float32 on the CPU. Stdlib only; ``encoders.hf`` supplies the device's list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FLOAT16_UNSUPPORTED", "DtypeChoice", "auto_dtype", "normalize_dtype", "widest_dtype"]

# vLLM 0.32's _FLOAT16_NOT_SUPPORTED_MODELS (numerical instability): model_type -> never float16.
FLOAT16_UNSUPPORTED = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})

_ALIASES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_SAFETENSORS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype ``auto`` chose and why (``GET /v1/model`` publishes ``reason``)."""

    dtype: str
    reason: str


def normalize_dtype(value: object) -> str | None:
    """A config's dtype (``"bfloat16"``, ``"torch.float16"``, ``"half"``...) as a dtype name, or None."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.").lower()
    return _ALIASES.get(name, name)


def widest_dtype(safetensors_dtypes: Sequence[str]) -> str | None:
    """The dtype every floating weight casts to without loss (vLLM's common_broadcastable_dtype):
    float32 if any weight is float32 (or the half dtypes are mixed), else the one half dtype."""
    names = {_SAFETENSORS[d] for d in safetensors_dtypes if d in _SAFETENSORS}
    if not names:
        return None
    if len(names) == 1:
        return names.pop()
    return "float64" if "float64" in names else "float32"


def auto_dtype(checkpoint: str | None, model_type: str, supported: Sequence[str], *, power_cpu: bool = False) -> str:
    """vLLM 0.32's ``auto`` for a checkpoint of ``checkpoint`` dtype (None: float32) on a device
    whose platform supports ``supported``, most preferred first."""
    allowed = [d for d in supported if not (d == "float16" and model_type in FLOAT16_UNSUPPORTED)]
    if not allowed:
        raise ValueError(f"no dtype of {list(supported)} is usable for model_type {model_type!r}")
    preferred = allowed[0]
    wanted = checkpoint or "float32"
    if wanted == "float32":
        wanted = preferred
    chosen = wanted if wanted in allowed else preferred
    if power_cpu and chosen in ("float16", "float32"):
        chosen = "bfloat16"
    return chosen
