"""Tiny seeded checkpoints, built once per session, and a few test images.

``<kind>_dir`` for every model type with a tiny builder in ``tests/tiny/records.py`` (``clip_dir``,
``qwen2_5_vl_dir``, ``gemma3_dir``...), so that a family's record is its fixtures too; ``qwen_dir``
is the Qwen2.5-VL one under its older name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from tests.tiny.records import RECORDS, Builder
from tests.unit.encoders.util import noise_image


def _checkpoint_fixture(kind: str, build: Builder) -> Callable[[pytest.TempPathFactory], Path]:
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build(tmp_path_factory.mktemp(kind))

    checkpoint.__doc__ = f"A tiny {kind} checkpoint (tests/tiny/records.py), built once per session."
    return pytest.fixture(scope="session", name=f"{kind}_dir")(checkpoint)


for _record in RECORDS.values():
    for _kind, _build in _record.builders.items():
        globals()[f"_{_kind}_dir"] = _checkpoint_fixture(_kind, _build)


@pytest.fixture(scope="session")
def qwen_dir(qwen2_5_vl_dir: Path) -> Path:
    return qwen2_5_vl_dir


@pytest.fixture
def image() -> Image.Image:
    return noise_image(100, 70)
