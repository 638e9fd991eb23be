"""The model fingerprint: content, not names; everything that changes the embedding, nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny_models import make_llava, make_qwen2_5_vl


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen"))


def _fp(path: Path, **kwargs: str) -> str:
    return model_fingerprint(load_encoder(str(path), device="cpu", **kwargs).info)


def _edit(src: Path, dst: Path, name: str, change: dict) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    for dotted, value in change.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (dst / name).write_text(json.dumps(data))
    return dst


def test_same_checkpoint_at_two_paths_shares_a_fingerprint(qwen_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(qwen_dir, tmp_path / "elsewhere" / "model")
    assert _fp(qwen_dir) == _fp(copy)


def test_architecture_change_with_the_same_weights_changes_it(qwen_dir: Path, tmp_path: Path) -> None:
    edited = _edit(qwen_dir, tmp_path / "m", "config.json", {"vision_config.window_size": 112})
    assert _fp(qwen_dir) != _fp(edited)


def test_preprocessing_change_changes_it(qwen_dir: Path, tmp_path: Path) -> None:
    edited = _edit(qwen_dir, tmp_path / "m", "preprocessor_config.json", {"image_mean": [0.5, 0.5, 0.5]})
    assert _fp(qwen_dir) != _fp(edited)


def test_dtype_changes_it(qwen_dir: Path) -> None:
    assert _fp(qwen_dir, dtype="float32") != _fp(qwen_dir, dtype="bfloat16")


def test_llava_feature_layer_changes_it(tmp_path: Path) -> None:
    base = make_llava(tmp_path / "llava")
    edited = _edit(base, tmp_path / "llava2", "config.json", {"vision_feature_layer": -1})
    assert _fp(base) != _fp(edited)
