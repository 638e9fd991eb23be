"""``--dtype auto`` at load time: a family a vLLM prefill consumes follows vLLM's ``auto`` for the
checkpoint (read as vLLM reads it) and this device, and says why; the others, and the builtin
model, keep bfloat16 on CUDA / float32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from encode_server.encoders import load_encoder
from encode_server.encoders.hf import checkpoint_dtype, platform_dtypes, resolve_device
from tests.tiny_models import make_qwen2_5_vl

CPU_PREFERRED = platform_dtypes(resolve_device("cpu"))[0][0]


def _with_dtype(src: Path, dst: Path, dtype: str | None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    for scope in (config, config.get("text_config", {}), config.get("vision_config", {})):
        scope.pop("dtype", None)
        scope.pop("torch_dtype", None)
    if dtype is not None:
        config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_bfloat16_checkpoint_runs_in_bfloat16_here_and_says_why(qwen_dir: Path, tmp_path: Path) -> None:
    checkpoint = _with_dtype(qwen_dir, tmp_path / "bf16", "bfloat16")
    encoder = load_encoder(str(checkpoint), device="cpu")
    assert encoder.info.dtype == CPU_PREFERRED == "bfloat16"
    assert "vLLM" in encoder.dtype_reason and "bfloat16 (config.json torch_dtype)" in encoder.dtype_reason


def test_a_float32_checkpoint_takes_the_devices_preferred_dtype(qwen_dir: Path) -> None:
    encoder = load_encoder(str(qwen_dir), device="cpu")
    assert encoder.info.dtype == CPU_PREFERRED
    assert "float32" in encoder.dtype_reason


def test_without_a_config_dtype_the_weights_say(qwen_dir: Path, tmp_path: Path) -> None:
    checkpoint = _with_dtype(qwen_dir, tmp_path / "nodtype", None)
    config = json.loads((checkpoint / "config.json").read_text())
    assert checkpoint_dtype(checkpoint, config) == ("float32", "the safetensors weights")


def test_a_flag_wins(qwen_dir: Path) -> None:
    encoder = load_encoder(str(qwen_dir), device="cpu", dtype="float32")
    assert (encoder.info.dtype, encoder.dtype_reason) == ("float32", "--dtype float32")


def test_families_without_an_epd_contract_and_the_builtin_keep_float32_on_the_cpu(clip_dir: Path) -> None:
    clip = load_encoder(str(clip_dir), device="cpu", output="hidden")
    assert clip.info.dtype == "float32" and "no EPD contract" in clip.dtype_reason
    builtin = load_encoder("builtin:tiny", device="cpu")
    assert builtin.info.dtype == "float32" and "builtin" in builtin.dtype_reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_checkpoint_is_read_from_its_config(tmp_path: Path, dtype: str) -> None:
    directory = make_qwen2_5_vl(tmp_path / dtype)
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = dtype
    assert checkpoint_dtype(directory, config) == (dtype, "config.json dtype")
