"""What every transformers-backed adapter shares: device and dtype choice, the processor call, the
move of inputs to the device and of outputs back to bytes, and the ``EncoderInfo`` they report."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from .base import EncodedTensor, EncoderInfo, VisionEncoder

__all__ = [
    "DTYPES",
    "HFEncoder",
    "LoadSpec",
    "apply_call_defaults",
    "architecture",
    "dtype_name",
    "processor_config",
    "resolve_device",
    "resolve_dtype",
    "to_encoded",
]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto``: the current CUDA device when there is one, else the CPU; otherwise as torch reads it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 elsewhere (CPU half precision is slow and less exact)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_encoded(tensor: torch.Tensor) -> EncodedTensor:
    """The tensor's raw little-endian bytes in its own dtype (bfloat16 stays bfloat16), on the CPU."""
    tensor = tensor.detach().to("cpu").contiguous()
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return EncodedTensor(data=data, shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype))


def processor_config(processor: Any) -> dict[str, Any]:
    """The image processor's settings, JSON-able, plus its class.

    The class matters: transformers saves the PIL and torchvision backends under one
    ``image_processor_type``, yet they resize differently, so they must not share a fingerprint.
    """
    config: dict[str, Any] = json.loads(processor.to_json_string())
    config["processor_class"] = type(processor).__name__
    return config


def apply_call_defaults(processor: Any, processor_class: type) -> dict[str, Any]:
    """Set on ``processor`` the image settings that the model's ``ProcessorMixin`` passes at call
    time; returns them.

    Those outrank the image processor's saved attributes (transformers merges a processor's own
    defaults, not the image processor's, into every call), so a checkpoint saved with another value
    is processed with these by transformers and by vLLM alike (InternVL's ``crop_to_patches=True``,
    Gemma 3's ``do_pan_and_scan=False``). Setting them makes the fingerprint and ``count_tokens``
    follow what is run.
    """
    defaults = getattr(processor_class, "images_kwargs", None)  # transformers 5.24
    if defaults is None:  # older releases: the processor's kwargs TypedDict
        defaults = getattr(getattr(processor_class, "valid_processor_kwargs", None), "_defaults", {})
        defaults = defaults.get("images_kwargs", {})
    applied = {k: v for k, v in defaults.items() if k != "return_tensors"}
    for name, value in applied.items():
        setattr(processor, name, value)
    return applied


# Keys that say where or by what a config was written, not what the model computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype"})


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def architecture(module: torch.nn.Module) -> dict[str, Any]:
    """The module's config as JSON, without the keys that vary by path, version or dtype, so
    replicas that mount one model at different paths share a fingerprint."""
    config = getattr(module, "config", None)
    if config is None:
        raise TypeError(f"{type(module).__name__} has no .config to fingerprint")
    return _stable(json.loads(config.to_json_string(use_diff=False)))


@dataclass(frozen=True)
class LoadSpec:
    """How ``load_encoder`` was asked to load a model, resolved (device and dtype are concrete)."""

    model_id: str
    revision: str | None
    device: torch.device
    dtype: torch.dtype
    output: str


class HFEncoder(VisionEncoder):
    """A transformers module plus its image processor.

    Invariants: ``module`` is in eval mode on ``device`` in ``dtype`` and holds only vision (and
    projector) weights; ``preprocess`` only reads shared state, so it is safe from any thread.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        processor: Any,
        spec: LoadSpec,
        *,
        kind: str,
        output: str,
        hidden_size: int,
        weights_digest: str,
        meaningless: bool = False,
    ) -> None:
        self.module = module
        self.processor = processor
        self.device = spec.device
        self.dtype = spec.dtype
        self.info = EncoderInfo(
            model_id=spec.model_id,
            revision=spec.revision,
            kind=kind,
            output=output,
            dtype=dtype_name(spec.dtype),
            device=str(spec.device),
            hidden_size=hidden_size,
            weights_digest=weights_digest,
            preprocessing=processor_config(processor),
            num_parameters=sum(p.numel() for p in module.parameters()),
            meaningless=meaningless,
            architecture=architecture(module),
        )

    def _process(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """The processor's tensors for one image, on the CPU in float32 (as the processor makes them)."""
        return dict(self.processor(images=image, return_tensors="pt"))

    def _to_device(self, tensors: Sequence[torch.Tensor], *, cast: bool = True) -> torch.Tensor:
        """Concatenate per-image inputs along dim 0 on the device; pixels cast to the compute dtype.

        On CUDA the batch goes through pinned host memory with a non-blocking copy: the copy is
        queued on the stream ahead of the forward pass, and the host thread goes on queueing the
        pass instead of waiting for the transfer (the same stream orders them)."""
        joined = torch.cat(list(tensors)) if len(tensors) > 1 else tensors[0]
        dtype = self.dtype if cast else None
        if self.device.type == "cuda":
            return joined.pin_memory().to(self.device, dtype=dtype, non_blocking=True)
        return joined.to(self.device, dtype=dtype)
