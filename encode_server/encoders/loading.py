"""Find a model's files and load only the vision tower's (and projector's) tensors from them.

A VLM checkpoint is mostly language model. We never build, read or download that part: the
adapter builds just the vision modules (``empty_module``: no random init, straight on the
device), the checkpoint's key list (the index json, or the safetensors headers) says which keys
and which shards we need, and only those tensors are read: each straight from its file into the
parameter that holds it (one copy of the weights in memory, never a state dict beside the module,
nor the file mapped: a ViT-B/32-sized tower loaded at twice its size before).

Checkpoints of one family name the same tensors differently: ``model.visual.*`` (current
transformers module names, found in some re-saved checkpoints) against ``visual.*`` (the original
hub checkpoints, and what transformers 5's ``save_pretrained`` writes). So an adapter passes several
``Layout``s, most specific first; the first one any checkpoint key matches is used. Loading is
``strict``: a vision tensor the checkpoint lacks, or an unknown one under a selected prefix, fails
loudly instead of leaving uninitialised memory in the model.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any, TypeVar

import blake3
import torch
from safetensors import safe_open
from transformers.initialization import no_init_weights

__all__ = [
    "CheckpointFiles",
    "Layout",
    "check_local_model",
    "empty_module",
    "load_vision_weights",
    "weights_digest",
]

Layout = Mapping[str, str]
"""Checkpoint key prefix -> module key prefix, e.g. ``{"model.visual.": ""}``."""

_CONFIG_FILES = [
    "config.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "*.safetensors.index.json",
]
_INDEX_NAME = "model.safetensors.index.json"
_DIGEST_TAG = b"encode-server/weights/v1"

M = TypeVar("M", bound=torch.nn.Module)


def check_local_model(model: str) -> Path | None:
    """The directory ``model`` names, or None for a hub id; ``FileNotFoundError`` when it is
    written as a path (``/``, ``.``, ``~``) and no such directory exists. Cheap, so the server
    checks it before it opens a port."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if model.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"no model directory at {model}")
    return None


@dataclass(frozen=True)
class CheckpointFiles:
    """A model's files: a local directory, or a hub snapshot whose weight shards are fetched on demand.

    For a hub id, ``resolve`` downloads only the configs, the processor's config and the safetensors
    index; ``path`` downloads a shard when a loader asks for it. ``revision`` is then the resolved
    commit, so every later file comes from the same snapshot.
    """

    directory: Path
    repo_id: str | None = None
    revision: str | None = None

    @classmethod
    def resolve(cls, model: str, revision: str | None = None) -> CheckpointFiles:
        if (local := check_local_model(model)) is not None:
            return cls(local)
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(model, revision=revision, allow_patterns=_CONFIG_FILES))
        return cls(snapshot, repo_id=model, revision=snapshot.name)

    def path(self, filename: str) -> Path:
        """The local path of ``filename``, downloading it from the hub if needed."""
        local = self.directory / filename
        if local.exists() or self.repo_id is None:
            return local
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, filename, revision=self.revision))

    def video_processor_config(self, *, or_image_config: bool = False) -> dict[str, Any] | None:
        """The video processor's saved settings, in either layout: nested in ``processor_config.json``
        (what transformers 5 writes) or ``video_preprocessor_config.json`` (hub checkpoints). With
        ``or_image_config``, then ``preprocessor_config.json``: transformers' own last resort, which is
        where Qwen2(.5)-VL hub checkpoints keep the settings their video processor is built from.
        Read as JSON: transformers' video processors need torchvision, which the server does not."""
        nested = self.directory / "processor_config.json"
        if nested.is_file() and isinstance(video := json.loads(nested.read_text()).get("video_processor"), dict):
            return dict(video)
        names = ["video_preprocessor_config.json"] + (["preprocessor_config.json"] if or_image_config else [])
        for name in names:
            if (separate := self.directory / name).is_file():
                return dict(json.loads(separate.read_text()))
        return None

    def processor_setting(self, name: str) -> Any:
        """A top-level setting of ``processor_config.json`` (the multimodal processor's, e.g.
        ``image_seq_length``: the placeholder length vLLM expands an image to), None when absent."""
        file = self.directory / "processor_config.json"
        return json.loads(file.read_text()).get(name) if file.is_file() else None

    def weight_map(self) -> dict[str, str]:
        """Every tensor key in the checkpoint -> the safetensors file that holds it."""
        indexes = sorted(self.directory.glob("*.safetensors.index.json"), key=lambda p: p.name != _INDEX_NAME)
        if indexes:
            return dict(json.loads(indexes[0].read_text())["weight_map"])
        files = sorted(self.directory.glob("*.safetensors"))
        if not files and self.repo_id is not None:
            files = [self.path("model.safetensors")]
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {self.directory} (other formats are not read)")
        weight_map: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), file.name))
        return weight_map


def _select(keys: Sequence[str], layouts: Sequence[Layout]) -> dict[str, str]:
    """Checkpoint key -> module key, under the first layout every prefix of which some checkpoint key
    matches; failing that (a checkpoint missing a part), the first that any key matches, so that the
    strict load names what is missing. Two layouts may share a prefix (``multi_modal_projector.``
    beside ``vision_tower.vision_model.`` or ``vision_tower.``): the full match decides."""
    candidates: list[dict[str, str]] = []
    for layout in layouts:
        prefixes = sorted(layout, key=len, reverse=True)
        selected: dict[str, str] = {}
        used: set[str] = set()
        for key in keys:
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            if prefix is not None:
                selected[key] = layout[prefix] + key[len(prefix) :]
                used.add(prefix)
        if selected and used == set(layout):
            return selected
        if selected:
            candidates.append(selected)
    if candidates:
        return candidates[0]
    wanted = sorted({p for layout in layouts for p in layout})
    raise ValueError(f"the checkpoint holds no tensors under any of the prefixes {wanted}")


# safetensors' dtype names (the format's spec) -> torch.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Entry:
    file: str
    offset: int  # of the tensor's first byte in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _entries(f: BufferedReader, name: str, keys: Sequence[str]) -> dict[str, _Entry]:
    """Where ``keys`` lie in the safetensors file ``name``, open as ``f``, from its header (the
    format: an 8-byte little-endian header length, the JSON header, then the data)."""
    f.seek(0)
    length = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(length))
    out = {}
    for key in keys:
        info = header[key]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{name}: tensor {key} has dtype {info['dtype']}, which is not read")
        begin, end = info["data_offsets"]
        out[key] = _Entry(name, 8 + length + begin, end - begin, _DTYPES[info["dtype"]], tuple(info["shape"]))
    return out


def _read_into(f: BufferedReader, entry: _Entry, target: torch.Tensor) -> None:
    """The tensor's bytes from the file into ``target`` (contiguous, on the CPU), no copy between."""
    f.seek(entry.offset)
    if f.readinto(target.reshape(-1).view(torch.uint8).numpy().data) != entry.nbytes:
        raise ValueError(f"{entry.file} ends inside a tensor: a truncated checkpoint?")


def load_vision_weights(module: torch.nn.Module, files: CheckpointFiles, layouts: Sequence[Layout]) -> str:
    """Fill ``module`` from the checkpoint (strictly: every tensor, nothing else); its weights digest.

    Each tensor is read from its file straight into the parameter (or, when the module's dtype or
    device differs from the checkpoint's, through one tensor-sized buffer that is then cast and
    copied), so the weights are held once. The digest is ``weights_digest`` of the tensors as the
    checkpoint stores them, taken as they pass.
    """
    weight_map = files.weight_map()
    selected = _select(list(weight_map), layouts)
    targets = module.state_dict()  # detached views of the module's own storage
    wanted = {module_key: key for key, module_key in selected.items()}
    missing, unexpected = sorted(targets.keys() - wanted.keys()), sorted(wanted.keys() - targets.keys())
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {files.repo_id or files.directory} does not match {type(module).__name__}: "
            f"missing {len(missing)} tensors {missing[:5]}, unexpected {len(unexpected)} {unexpected[:5]}"
        )
    by_file: dict[str, list[str]] = defaultdict(list)
    for key in selected:
        by_file[weight_map[key]].append(key)
    hasher = _digest_start(len(targets))
    with ExitStack() as stack, torch.no_grad():
        handles = {name: stack.enter_context(open(files.path(name), "rb")) for name in by_file}
        entries: dict[str, _Entry] = {}
        for name, keys in by_file.items():
            entries.update(_entries(handles[name], name, keys))
        for module_key in sorted(targets):
            entry, target = entries[wanted[module_key]], targets[module_key]
            if entry.shape != tuple(target.shape):
                raise ValueError(f"checkpoint tensor {wanted[module_key]} has shape {list(entry.shape)}, "
                                 f"the model's {module_key} {list(target.shape)}")
            direct = entry.dtype == target.dtype and target.device.type == "cpu" and target.is_contiguous()
            buffer = target if direct else torch.empty(entry.shape, dtype=entry.dtype)
            _read_into(handles[entry.file], entry, buffer)
            _digest_update(hasher, module_key, buffer)
            if not direct:
                target.copy_(buffer)
            del buffer
    return hasher.hexdigest()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def empty_module(factory: Callable[[], M], device: torch.device, dtype: torch.dtype) -> M:
    """``factory()`` built on ``device`` in ``dtype`` with parameter init skipped, in eval mode.

    Parameters hold garbage until ``load_vision_weights`` fills them; buffers computed in
    ``__init__`` (rotary frequencies, position ids) are real. Skipping init matters: a 600M-parameter
    tower takes tens of seconds to randomly initialise on a CPU only to be overwritten. Not
    thread-safe (it patches torch's init functions and the default dtype): call it at start-up.
    """
    with torch.device(device), no_init_weights(), _default_dtype(dtype):
        module = factory()
    return module.eval()


def _frame(hasher: blake3.blake3, data: bytes | memoryview) -> None:
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """BLAKE3 hex over a state dict, framed so that distinct dicts never serialise alike.

    Keys in sorted order; for each: key, dtype, shape and raw bytes, each length-prefixed. Hence
    no collision from shifting a key boundary, reinterpreting the same bytes as another dtype or
    shape, or moving bytes between tensors.
    """
    hasher = _digest_start(len(state))
    for key in sorted(state):
        _digest_update(hasher, key, state[key])
    return hasher.hexdigest()


def _digest_start(count: int) -> blake3.blake3:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)  # same digest; faster on GB of weights
    _frame(hasher, _DIGEST_TAG)
    _frame(hasher, count.to_bytes(8, "little"))
    return hasher


def _digest_update(hasher: blake3.blake3, key: str, tensor: torch.Tensor) -> None:
    """One tensor of ``weights_digest``: the keys must come in sorted order."""
    tensor = tensor.detach().to("cpu").contiguous()
    _frame(hasher, key.encode())
    _frame(hasher, str(tensor.dtype).removeprefix("torch.").encode())
    _frame(hasher, b"".join(int(d).to_bytes(8, "little") for d in tensor.shape))
    _frame(hasher, tensor.reshape(-1).view(torch.uint8).numpy().data)
