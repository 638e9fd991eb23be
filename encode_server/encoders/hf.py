"""What every transformers-backed adapter shares: device and dtype choice, the processor call, the
move of inputs to the device and of outputs back to bytes, batched preprocessing on the device
(``batched.py``) when it is on, and the ``EncoderInfo`` they report."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import platform
import subprocess
import sys
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from encode_server.core.dtypes import DtypeChoice, auto_dtype, normalize_dtype, widest_dtype
from encode_server.core.errors import EncodeServerError

from .base import EncodedTensor, Encoder, EncoderInfo, PreparedItem
from .batched import BatchedPipeline

__all__ = [
    "DTYPES",
    "HFEncoder",
    "LoadSpec",
    "apply_call_defaults",
    "architecture",
    "checkpoint_dtype",
    "dtype_name",
    "platform_dtypes",
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


def platform_dtypes(device: torch.device) -> tuple[list[str], bool, str]:
    """(the dtypes vLLM 0.32's platform supports on ``device``, most preferred first; whether it is
    a POWER CPU; the device in words), as ``vllm/platforms/{cuda,cpu}.py`` say."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        if (major, minor) >= (8, 0):
            return ["bfloat16", "float16", "float32"], False, where
        if (major, minor) >= (6, 0):
            return ["float16", "float32"], False, where
        return ["float32"], False, where
    machine = platform.machine().lower()
    where = f"the CPU ({machine})"
    if machine.startswith("ppc"):
        return ["bfloat16", "float32", "float16"], True, where
    if sys.platform == "darwin" and machine.startswith(("arm", "aarch")):
        probe = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, check=False)
        if probe.stdout.strip() != b"1":
            return ["float16", "float32"], False, where
    return ["bfloat16", "float16", "float32"], False, where


def resolve_dtype(
    dtype: str,
    device: torch.device,
    *,
    checkpoint: str | None = None,
    source: str = "",
    model_type: str | None = None,
    family: str | None = None,
) -> DtypeChoice:
    """The compute dtype and why. ``auto`` for a checkpoint a vLLM prefill consumes (``model_type``
    set; ``checkpoint`` its dtype, read from ``source``): vLLM 0.32's ``auto`` (``core.dtypes``).
    ``auto`` otherwise (the builtin model; a ``family`` without an EPD contract): bfloat16 on CUDA,
    float32 elsewhere (CPU half precision is slower on many CPUs, and less exact). Anything else:
    as given."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, not {dtype!r}")
        return DtypeChoice(dtype, f"--dtype {dtype}")
    if model_type is None:
        chosen = "bfloat16" if device.type == "cuda" else "float32"
        why = f"family {family} has no EPD contract (no vLLM prefill consumes it)" if family else (
            "the builtin model has no checkpoint dtype"
        )
        return DtypeChoice(chosen, f"auto: {chosen} on {device.type}, as {why}")
    supported, power_cpu, where = platform_dtypes(device)
    chosen = auto_dtype(checkpoint, model_type, supported, power_cpu=power_cpu)
    found = f"the checkpoint is {checkpoint} ({source})" if checkpoint else "the checkpoint names no dtype (float32)"
    reason = f"auto, as vLLM 0.32 chooses: {found}; {where} supports {', '.join(supported)}"
    return DtypeChoice(chosen, f"{reason} -> {chosen}")


def checkpoint_dtype(directory: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    """The checkpoint's dtype as vLLM reads it, and where it was found: ``config.json``'s
    ``dtype``/``torch_dtype``, then its text, vision and encoder configs', then the widest dtype of
    the local safetensors weights' headers; (None, "") when none says."""
    scopes = [("config.json", config)]
    for sub in ("text_config", "vision_config", "encoder_config"):
        if isinstance(config.get(sub), Mapping):
            scopes.append((f"config.json {sub}", config[sub]))
    for where, scope in scopes:
        for key in ("dtype", "torch_dtype"):
            if (name := normalize_dtype(scope.get(key))) is not None:
                return name, f"{where} {key}"
    found: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        found += [info["dtype"] for key, info in header.items() if key != "__metadata__"]
    widest = widest_dtype(found)
    return (widest, "the safetensors weights") if widest else (None, "")


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


def _pickles(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # whatever pickle raises: the value stays behind
        return False
    return True


class HFEncoder(Encoder):
    """A transformers module plus its image processor.

    Invariants: ``module`` is in eval mode on ``device`` in ``dtype`` and holds only vision (and
    projector) weights; ``preprocess`` and ``defer`` only read shared state, so they are safe from
    any thread. Subclasses implement ``_forward`` over a batch's inputs already on the device (the
    CPU path's per-image tensors concatenated, or the batched pipeline's output: the same tensors)
    and ``cost_of``.
    """

    batched: BatchedPipeline | None = None
    # The meta fields the batched processor also makes, as tensors of the same name, that must agree
    # with what ``defer`` computed from the header (the token count and grid the batcher budgeted
    # and the client is told). The family's encoder names its own (Qwen's grid, SigLIP2's shapes).
    checked_meta: ClassVar[tuple[str, ...]] = ()

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

    @property
    def preprocesses_on_device(self) -> bool:
        return self.batched is not None

    def use_batched(self, pipeline: BatchedPipeline) -> None:
        """Preprocess on the device from now on (at load, before serving). The fingerprint changes
        with it: another decoder and other resize kernels give other (close) embeddings."""
        self.batched = pipeline
        preprocessing = {**processor_config(pipeline.processor), "pipeline": f"batched:{pipeline.device.type}"}
        self.info = dataclasses.replace(self.info, preprocessing=preprocessing)

    @abstractmethod
    def cost_of(self, num_tokens: int, meta: dict[str, Any]) -> int:
        """The patch tokens an image of this count and meta costs through the tower."""

    def host_twin(self) -> Encoder | None:
        """A shallow copy with every module dropped, and whatever does not pickle (the forward's
        caches): ``preprocess`` reads the processor and plain settings only (the class invariant;
        ``preprocess_procs`` checks a worker's inputs against these at start). None when a device
        pipeline preprocesses."""
        if self.batched is not None:
            return None
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.nn.Module) or not _pickles(value):
                setattr(twin, name, None)
        return twin

    def defer(self, data: bytes, *, max_pixels: int, index: int | None = None) -> PreparedItem | None:
        if self.batched is None:
            return None
        pending, width, height = self.batched.prepare(data, max_pixels=max_pixels, index=index)
        num_tokens, meta = self.count_tokens(width, height)
        cost = self.cost_of(num_tokens, meta)
        return PreparedItem({}, num_tokens, cost, meta, pending=pending, held_bytes=pending.held_bytes)

    def forward(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        if not batch:
            return []
        # Inputs made on the CPU: every item without a batched path, and a video's with one.
        ready = [i for i, item in enumerate(batch) if self.batched is None or item.pending is None]
        if len(ready) == len(batch):
            inputs = {key: self._to_device([item.inputs[key] for item in batch], cast=key == "pixel_values")
                      for key in batch[0].inputs}
            return list(self._forward(batch, inputs))
        if ready:  # images waiting for the batched path beside items prepared on the CPU: one pass each
            out: list[EncodedTensor | EncodeServerError | None] = [None] * len(batch)
            waiting = [i for i in range(len(batch)) if batch[i].pending is not None]
            for indices in (ready, waiting):
                for i, result in zip(indices, self.forward([batch[i] for i in indices]), strict=True):
                    out[i] = result
            return [result for result in out if result is not None]
        return self._forward_batched(batch)

    def _forward_batched(self, batch: Sequence[PreparedItem]) -> list[EncodedTensor | EncodeServerError]:
        """Every item of ``batch`` waits as bytes or pixels: decoded and preprocessed on the device."""
        assert self.batched is not None
        made, errors = self.batched.run([item.pending for item in batch])
        decoded = [item for item, error in zip(batch, errors, strict=True) if error is None]
        if made is None:  # not one image decoded
            return [error for error in errors if error is not None]
        inputs = {key: value.to(self.device, dtype=self.dtype if key == "pixel_values" else None, non_blocking=True)
                  for key, value in made.items()}
        self._check_meta(decoded, made)
        encoded = iter(self._forward(decoded, inputs))
        return [error if error is not None else next(encoded) for error in errors]

    def _check_meta(self, batch: Sequence[PreparedItem], made: dict[str, torch.Tensor]) -> None:
        for key in self.checked_meta:
            if key not in made or not batch or key not in batch[0].meta:
                continue
            for item, row in zip(batch, made[key].tolist(), strict=True):
                if item.meta[key] != [int(x) for x in row]:
                    raise RuntimeError(f"the batched processor made {key} {row}, the header said {item.meta[key]}")

    @abstractmethod
    def _forward(self, batch: Sequence[PreparedItem], inputs: dict[str, torch.Tensor]) -> list[EncodedTensor]:
        """The embeddings of ``batch`` from its inputs, on the device (pixels in the compute dtype)."""

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Output back to the host; from CUDA through pinned memory (a page-locked copy runs at
        the bus's speed, a pageable one at a fraction of it, staged by the driver)."""
        if self.device.type != "cuda":
            return tensor.to("cpu")
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

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
