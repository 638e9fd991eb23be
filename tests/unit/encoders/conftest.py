"""Tiny seeded checkpoints, built once per session, and a few test images."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from tests.tiny.gemma3 import make_tiny_gemma3
from tests.tiny.glm4v import make_tiny_glm4v
from tests.tiny.internvl import make_tiny_internvl
from tests.tiny.llava_next import make_tiny_llava_next
from tests.tiny.llava_onevision import make_tiny_llava_onevision
from tests.tiny.mistral3 import make_tiny_mistral3
from tests.tiny_models import make_clip, make_llava, make_qwen2_5_vl, make_qwen2_vl
from tests.unit.encoders.util import noise_image


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(tmp_path_factory.mktemp("siglip"), kind="siglip")


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture
def image() -> Image.Image:
    return noise_image(100, 70)


@pytest.fixture(scope="session")
def siglip2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(tmp_path_factory.mktemp("siglip2"), kind="siglip2")


@pytest.fixture(scope="session")
def internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_internvl(tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def mistral3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="session")
def glm4v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4v(tmp_path_factory.mktemp("glm4v"))


@pytest.fixture(scope="session")
def llava_onevision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava_onevision(tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="session")
def llava_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava_next(tmp_path_factory.mktemp("llava_next"))
