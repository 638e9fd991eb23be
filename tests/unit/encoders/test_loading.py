"""Checkpoint reading: only vision tensors, any known layout, strictly; and the weights digest."""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import huggingface_hub
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import encode_server.encoders as encoders
from encode_server.encoders import Encoder, load_encoder
from encode_server.encoders.loading import weights_digest
from tests.tiny_models import reference_qwen_features
from tests.unit.encoders.util import decode


def rewrite_checkpoint(
    src: Path,
    dst: Path,
    *,
    rename: Callable[[str], str | None] = lambda key: key,
    shard_of: Callable[[str], str] = lambda key: "model.safetensors",
) -> Path:
    """A copy of ``src`` with keys renamed (``None`` drops one) and spread over shards with an index."""
    dst.mkdir(parents=True)
    for config in src.glob("*.json"):
        shutil.copy(config, dst)
    shards: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in load_file(src / "model.safetensors").items():
        new_key = rename(key)
        if new_key is not None:
            shards[shard_of(new_key)][new_key] = tensor
    for name, tensors in shards.items():
        save_file(tensors, dst / name, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {key: name for name, tensors in shards.items() for key in tensors}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def assert_matches_reference(encoder: Encoder, qwen_dir: Path, image: Image.Image) -> None:
    [encoded] = encoder.forward([encoder.preprocess(image)])
    assert torch.equal(decode(encoded), reference_qwen_features(qwen_dir, image)[0])


def to_transformers5_layout(key: str) -> str:
    """Legacy Qwen2.5-VL keys (``visual.*``, ``model.layers.*``) as newer transformers name the modules."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key.removeprefix("model.")
    return key


def test_transformers5_and_legacy_layouts_load_the_same_weights(
    qwen_dir: Path, tmp_path: Path, image: Image.Image
) -> None:
    legacy = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    modern = load_encoder(
        str(rewrite_checkpoint(qwen_dir, tmp_path / "t5", rename=to_transformers5_layout)), device="cpu",
        dtype="float32",
    )
    assert modern.info.weights_digest == legacy.info.weights_digest
    assert torch.equal(
        decode(modern.forward([modern.preprocess(image)])[0]), reference_qwen_features(qwen_dir, image)[0]
    )


def shard_of(key: str) -> str:
    """Vision tensors over two shards, the language model in a third."""
    if key.startswith("visual.blocks.0."):
        return "model-00001-of-00003.safetensors"
    if key.startswith("visual."):
        return "model-00002-of-00003.safetensors"
    return "model-00003-of-00003.safetensors"


def test_language_model_shards_are_never_opened(qwen_dir: Path, tmp_path: Path, image: Image.Image) -> None:
    sharded = rewrite_checkpoint(qwen_dir, tmp_path / "sharded", shard_of=shard_of)
    (sharded / "model-00003-of-00003.safetensors").unlink()  # the language model: listed, but gone
    encoder = load_encoder(str(sharded), device="cpu", dtype="float32")
    assert torch.equal(
        decode(encoder.forward([encoder.preprocess(image)])[0]), reference_qwen_features(qwen_dir, image)[0]
    )


def test_a_hub_model_downloads_configs_then_only_vision_shards(
    qwen_dir: Path, tmp_path: Path, image: Image.Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub calls are faked by a local "remote"; what matters is which files are asked for."""
    remote = rewrite_checkpoint(qwen_dir, tmp_path / "remote", shard_of=shard_of)
    commit = "c0ffee" * 6 + "beef"
    snapshot = tmp_path / "hub" / "snapshots" / commit
    downloaded: list[str] = []

    def snapshot_download(repo_id: str, revision: str | None = None, allow_patterns: list[str] | None = None) -> str:
        assert (repo_id, revision) == ("org/tiny-qwen", "main")
        snapshot.mkdir(parents=True)
        for file in remote.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns or ["*"]):
                downloaded.append(file.name)
                shutil.copy(file, snapshot)
        return str(snapshot)

    def hf_hub_download(repo_id: str, filename: str, revision: str | None = None) -> str:
        assert (repo_id, revision) == ("org/tiny-qwen", commit)  # later files come from the same snapshot
        downloaded.append(filename)
        return str(shutil.copy(remote / filename, snapshot))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    encoder = load_encoder("org/tiny-qwen", device="cpu", revision="main", dtype="float32")
    assert sorted(downloaded) == [
        "config.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model.safetensors.index.json",
        "preprocessor_config.json",
    ]
    assert (encoder.info.model_id, encoder.info.revision) == ("org/tiny-qwen", commit)
    assert_matches_reference(encoder, qwen_dir, image)


def test_a_missing_vision_tensor_fails_loudly(qwen_dir: Path, tmp_path: Path) -> None:
    dropped = "visual.blocks.1.mlp.down_proj.weight"
    broken = rewrite_checkpoint(qwen_dir, tmp_path / "broken", rename=lambda key: None if key == dropped else key)
    with pytest.raises(ValueError, match=r"missing 1 tensors \['blocks\.1\.mlp\.down_proj\.weight'\]"):
        load_encoder(str(broken), device="cpu")


def test_a_checkpoint_without_vision_tensors_says_so(qwen_dir: Path, tmp_path: Path) -> None:
    text_only = rewrite_checkpoint(qwen_dir, tmp_path / "text", rename=lambda k: None if k.startswith("visual.") else k)
    with pytest.raises(ValueError, match="no tensors under any of the prefixes"):
        load_encoder(str(text_only), device="cpu")


def _vision_state(encoder: Encoder) -> dict[str, torch.Tensor]:
    return encoder.module.state_dict()  # type: ignore[attr-defined]


def test_every_tensor_lands_in_the_module_as_stored(clip_dir: Path) -> None:
    """Read from the file straight into the parameters: each equals the checkpoint's tensor."""
    stored = {k.removeprefix("vision_model."): v for k, v in load_file(clip_dir / "model.safetensors").items()}
    state = _vision_state(load_encoder(str(clip_dir), device="cpu", output="hidden"))
    assert state.keys() <= stored.keys()
    for key, tensor in state.items():
        assert torch.equal(tensor, stored[key]), key


def test_a_checkpoint_in_another_dtype_is_cast_and_keeps_its_digest(clip_dir: Path, tmp_path: Path) -> None:
    """bfloat16 on disk, float32 in the module (the buffered path): the values are the stored ones,
    and the digest is of the checkpoint as stored, not of the cast."""
    half = tmp_path / "bf16"
    shutil.copytree(clip_dir, half)
    stored = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
              for k, v in load_file(clip_dir / "model.safetensors").items()}
    save_file(stored, half / "model.safetensors", metadata={"format": "pt"})
    as_float = load_encoder(str(half), device="cpu", dtype="float32", output="hidden")
    as_bf16 = load_encoder(str(half), device="cpu", dtype="bfloat16", output="hidden")
    assert as_float.info.weights_digest == as_bf16.info.weights_digest
    for key, tensor in _vision_state(as_float).items():
        assert tensor.dtype == torch.float32 or not tensor.is_floating_point()
        assert torch.equal(tensor, stored["vision_model." + key].to(tensor.dtype)), key


def test_a_truncated_shard_fails_loudly(clip_dir: Path, tmp_path: Path) -> None:
    """Sharded, the index (not the shard) lists the keys: the read itself finds the cut."""
    cut = rewrite_checkpoint(
        clip_dir, tmp_path / "cut", shard_of=lambda key: "a.safetensors" if "encoder" in key else "b.safetensors"
    )
    shard = cut / "a.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4096])
    with pytest.raises(ValueError, match="truncated"):
        load_encoder(str(cut), device="cpu", output="hidden")


def test_a_tensor_of_the_wrong_shape_is_named(clip_dir: Path, tmp_path: Path) -> None:
    key = "vision_model.post_layernorm.weight"
    wrong = rewrite_checkpoint(clip_dir, tmp_path / "wrong")
    tensors = load_file(wrong / "model.safetensors")
    tensors[key] = torch.cat([tensors[key], tensors[key]])
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"post_layernorm\.weight has shape"):
        load_encoder(str(wrong), device="cpu", output="hidden")


def test_unknown_model_type_is_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        load_encoder(str(tmp_path), device="cpu")


def test_a_missing_local_directory_is_not_looked_up_on_the_hub(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_encoder(str(tmp_path / "nowhere"), device="cpu")


def test_unknown_dtype_and_builtin_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_encoder("builtin:tiny", dtype="int8")
    with pytest.raises(ValueError, match="builtin:huge"):
        load_encoder("builtin:huge")


def test_public_surface() -> None:
    assert set(encoders.__all__) == {
        "BUILTIN_MODELS",
        "FAMILIES",
        "PREPROCESS_DEVICES",
        "SUPPORTED_MODEL_TYPES",
        "EncodedTensor",
        "EncoderInfo",
        "Epd",
        "Family",
        "PreparedItem",
        "Encoder",
        "check_local_model",
        "load_encoder",
    }
    assert all(hasattr(encoders, name) for name in encoders.__all__)


def test_a_model_written_as_a_path_must_be_a_directory(tmp_path: Path) -> None:
    """What the server checks before it opens a port; a hub id or builtin: is left to the loader."""
    assert encoders.check_local_model(str(tmp_path)) == tmp_path
    for missing in ("/nonexistent/dir", "./nope", "~/no-such-model-dir"):
        with pytest.raises(FileNotFoundError, match="no model directory"):
            encoders.check_local_model(missing)
    assert encoders.check_local_model("Qwen/Qwen2.5-VL-7B-Instruct") is None
    assert encoders.check_local_model("builtin:tiny") is None


class TestWeightsDigest:
    """Distinct state dicts never serialise alike; equal ones always do."""

    def test_insertion_order_does_not_matter(self) -> None:
        a, b = torch.arange(4.0), torch.ones(2, 2)
        assert weights_digest({"a": a, "b": b}) == weights_digest({"b": b, "a": a})

    def test_moving_a_key_boundary_changes_it(self) -> None:
        t = torch.zeros(1)
        assert weights_digest({"ab": t, "c": t}) != weights_digest({"a": t, "bc": t})

    def test_same_bytes_as_another_dtype_change_it(self) -> None:
        floats = torch.tensor([1.0, 2.0])
        assert weights_digest({"w": floats}) != weights_digest({"w": floats.view(torch.int32)})

    def test_same_bytes_in_another_shape_change_it(self) -> None:
        t = torch.arange(6.0)
        assert weights_digest({"w": t.reshape(2, 3)}) != weights_digest({"w": t.reshape(3, 2)})

    def test_moving_bytes_between_tensors_changes_it(self) -> None:
        t = torch.arange(4.0)
        assert weights_digest({"a": t[:1], "b": t[1:]}) != weights_digest({"a": t[:2], "b": t[2:]})

    def test_one_bit_changes_it(self) -> None:
        t = torch.zeros(8)
        flipped = t.clone()
        flipped.view(torch.int32)[5] ^= 1
        assert weights_digest({"w": t}) != weights_digest({"w": flipped})

    def test_bfloat16_is_hashed_as_its_own_bytes(self) -> None:
        t = torch.randn(5).to(torch.bfloat16)
        assert len(weights_digest({"w": t})) == 64
        assert weights_digest({"w": t}) != weights_digest({"w": t.float()})


def test_the_layout_all_of_whose_parts_match_is_chosen(llava_dir: Path, tmp_path: Path, image: Image.Image) -> None:
    """The hub's LLaVA layout (``vision_tower.vision_model.*``) and transformers 5's (no ``vision_model``)
    share the ``multi_modal_projector.`` prefix: both load, to the same embedding."""
    from safetensors.torch import load_file, save_file

    from tests.tiny import hub_tower_layout

    hub = shutil.copytree(llava_dir, tmp_path / "hub")
    hub_tower_layout(hub)
    assert any(k.startswith("vision_tower.vision_model.") for k in load_file(hub / "model.safetensors"))
    flat, nested = load_encoder(str(llava_dir), device="cpu"), load_encoder(str(hub), device="cpu")
    assert flat.info.weights_digest == nested.info.weights_digest
    assert flat.forward([flat.preprocess(image)])[0].data == nested.forward([nested.preprocess(image)])[0].data
    state = load_file(hub / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("multi_modal_projector.")}, hub / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):  # a part missing: the strict load names it
        load_encoder(str(hub), device="cpu")
