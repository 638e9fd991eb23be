"""What the container test (tests/container, which builds the image) cannot see from one build: the
torch pin has one home, the dev venv has it, and a plain build is given no pip setting at all."""

from __future__ import annotations

import re
import shutil
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PIP_ARGS = ("TORCH_INDEX_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST")


def torch_pin() -> str:
    lines = [line for line in (ROOT / "deploy/torch.txt").read_text().splitlines() if line and line[0] != "#"]
    assert len(lines) == 1 and re.fullmatch(r"torch==[\d.]+", lines[0]), lines
    return lines[0].removeprefix("torch==")


def test_the_torch_pin_lives_in_one_file_that_the_image_and_the_venv_both_use() -> None:
    pin = torch_pin()
    assert "deploy/torch.txt" in DOCKERFILE and "deploy/torch.txt" in (ROOT / "Makefile").read_text()
    assert "!deploy/torch.txt" in (ROOT / ".dockerignore").read_text()
    assert not re.search(r"torch\s*==", DOCKERFILE), "the Dockerfile names a torch version of its own"
    # Without a GPU, `make install` installs the pinned CPU build first (2.13.0+cpu).
    if shutil.which("nvidia-smi") is None:
        assert version("torch").split("+")[0] == pin


def test_pip_settings_are_build_arguments_unset_by_default() -> None:
    for arg in PIP_ARGS:
        declared = re.findall(rf"^ARG {arg}(=.*)?$", DOCKERFILE, re.M)
        assert declared == [""], (arg, declared)  # declared once, without a default
        assert not re.search(rf"^ENV .*\b{arg}=", DOCKERFILE, re.M), arg
    # Both variants take the same steps: only the base image and the torch index differ.
    assert DOCKERFILE.count("FROM base-${VARIANT}") == 2
