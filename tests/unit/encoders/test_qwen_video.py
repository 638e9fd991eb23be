"""Qwen2-VL / Qwen2.5-VL videos: the three places a checkpoint keeps its video settings, the settings
fingerprinted, the plan vLLM's loader and processor make, and a video's rows (whole, or split into
runs of groups through the windowed tower) equal to the full model's ``get_video_features``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from encode_server.core.types import VideoInfo
from encode_server.encoders import load_encoder
from encode_server.fingerprints import model_fingerprint
from tests.tiny_models import load_full_model
from tests.unit.encoders.util import decode
from tests.videos import frames
from tests.vllm.tiny_qwen import VIDEO_PROCESSOR, make_tiny_qwen2_5_vl

CPU32: dict[str, str] = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def nested_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("q25_nested"), video={}, layout="nested")


def test_the_three_layouts_of_video_settings_load(nested_dir: Path, tmp_path: Path) -> None:
    """Nested in processor_config.json (transformers 5), video_preprocessor_config.json (hub), and
    preprocessor_config.json alone (transformers' last resort: older Qwen2(.5)-VL hub checkpoints)."""
    hub = make_tiny_qwen2_5_vl(tmp_path / "hub", video={}, layout="hub")
    image_only = make_tiny_qwen2_5_vl(tmp_path / "image_only")
    nested, split, fallback = (load_encoder(str(d), **CPU32) for d in (nested_dir, hub, image_only))
    assert nested.info.preprocessing == split.info.preprocessing
    assert model_fingerprint(nested.info) == model_fingerprint(split.info)
    assert nested.video.max_pixels == VIDEO_PROCESSOR["size"]["longest_edge"]  # type: ignore[attr-defined]
    image = json.loads((image_only / "preprocessor_config.json").read_text())
    assert fallback.video.max_pixels == image["size"]["longest_edge"] != nested.video.max_pixels  # type: ignore[attr-defined]
    assert model_fingerprint(fallback.info) != model_fingerprint(nested.info)


@pytest.mark.parametrize(("key", "value"), [("fps", 1.0), ("cap_pixels_per_frame", True),
                                            ("size", {"shortest_edge": 3136, "longest_edge": 50176})])
def test_every_video_setting_changes_the_fingerprint(nested_dir: Path, tmp_path: Path, key: str, value: object) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(nested_dir, edited)
    config = json.loads((edited / "processor_config.json").read_text())
    config["video_processor"][key] = value
    (edited / "processor_config.json").write_text(json.dumps(config))
    before = model_fingerprint(load_encoder(str(nested_dir), **CPU32).info)
    assert model_fingerprint(load_encoder(str(edited), **CPU32).info) != before


@pytest.mark.parametrize(
    ("spec", "indices", "grid", "seconds"),
    [((4, 2.0, 56, 56), [0, 1, 2, 3], [2, 4, 4], 1.0),  # all frames: 2 fps exactly
     ((5, 2.0, 56, 56), [0, 1, 2, 3], [2, 4, 4], 1.25),  # 5 -> 4 (whole groups): 1.6 fps
     ((21, 6.0, 56, 56), [0, 3, 7, 10, 14, 17], [3, 4, 4], 2 / (6 / 21 * 6)),
     ((60, 30.0, 200, 100), [0, 15, 30, 45], [2, 4, 10], 1.0),  # resized to 56 x 140
     ((3, 1.0, 28, 28), [0, 1], [1, 4, 4], 2 / (2 / 3))],  # below min_frames: 2 of 3; upscaled
)
def test_the_plan_is_vllms_loader_and_processor(
    nested_dir: Path, spec: tuple[int, float, int, int], indices: list[int], grid: list[int], seconds: float
) -> None:
    """Expected values worked by hand from Qwen2VLVideoBackend and Qwen2_5_VLProcessor (vLLM 0.32,
    transformers 5.19); tests/vllm/test_qwen25_video.py checks them against vLLM itself."""
    count, fps, width, height = spec
    plan = load_encoder(str(nested_dir), **CPU32).plan_video(VideoInfo(width, height, count, fps, "h264"), 2.0)
    assert list(plan.indices) == indices
    assert plan.meta["video_grid_thw"] == grid and plan.meta["second_per_grid_ts"] == pytest.approx(seconds)
    assert plan.num_tokens == grid[0] * grid[1] * grid[2] // 4


def test_one_frame_is_refused(nested_dir: Path) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        load_encoder(str(nested_dir), **CPU32).plan_video(VideoInfo(56, 56, 1, 2.0, "h264"), 2.0)


def test_rows_whole_or_split_equal_the_full_models_video_features(nested_dir: Path) -> None:
    """Qwen2.5-VL's windows lie within a temporal group, so runs of groups encode to the same rows."""
    encoder = load_encoder(str(nested_dir), **CPU32)
    plan = encoder.plan_video(VideoInfo(84, 56, 12, 4.0, "h264"), 2.0)
    prepared = encoder.preprocess_video(frames(12, 84, 56)[list(plan.indices)], plan)
    got = decode(encoder.forward([prepared])[0])
    parts = encoder.split(prepared, 2 * 4 * 6)
    assert len(parts) == 2 and [p.inputs["image_grid_thw"][0, 0].item() for p in parts] == [2, 1]
    split = torch.cat([decode(encoder.forward([p])[0]) for p in parts])
    full: Any = load_full_model(nested_dir)
    with torch.inference_mode():
        reference = full.get_video_features(
            prepared.inputs["pixel_values"], prepared.inputs["image_grid_thw"]
        ).pooler_output[0]
    assert got.shape == (3 * 4 * 6 // 4, 64)
    torch.testing.assert_close(got, reference, atol=2e-5 * reference.abs().max().item(), rtol=0)
    torch.testing.assert_close(split, got, atol=1e-6 * got.abs().max().item(), rtol=0)


def test_qwen2_vl_videos_carry_the_grid_only(tmp_path: Path) -> None:
    """Qwen2-VL's M-RoPE does not scale time, and its processor gives no second_per_grid_ts."""
    from tests.tiny_models import make_qwen2_vl

    encoder = load_encoder(str(make_qwen2_vl(tmp_path / "q2")), **CPU32)
    plan = encoder.plan_video(VideoInfo(56, 56, 5, 2.0, "h264"), 2.0)
    assert plan.meta == {"video_grid_thw": [2, 4, 4]}
