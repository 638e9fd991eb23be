"""The GPU check's luggage: the wheel set is derived from the pyproject files against the device's
package list, resolves there, and the check that guards it fails when a wheel is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from scripts import gpu_wheels

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".gpu" / "wheels"
# H200.md names these as missing on the device; torch and the rest of its stack are there.
MISSING_THERE = {
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "blake3",
    "redis", "pybase64", "orjson", "python-multipart", "grpcio-health-checking",
}
THERE = {"torch", "torchvision", "transformers", "numpy", "pillow", "safetensors", "httpx", "huggingface-hub",
         "prometheus-client", "uvloop"}


def _downloaded() -> Path:
    if not WHEELS.is_dir():
        pytest.fail("no .gpu/wheels: `make gpu-wheels` (a part of `make test`) downloads them")
    return WHEELS


def test_the_derived_set_is_what_the_device_lacks() -> None:
    names = {c.name for c in gpu_wheels.derive(gpu_wheels.device_packages())}
    assert names >= MISSING_THERE
    assert not names & THERE
    assert names >= gpu_wheels.CARRY_ANYWAY  # the generated gRPC code checks their versions at import
    assert "py-spy" in names  # the check's own: the ceiling's GIL figures


def test_the_downloaded_set_is_the_derived_one_and_resolves_against_the_device() -> None:
    wheels = _downloaded()
    device = gpu_wheels.device_packages()
    on_disk = {w.name: str(w.version) for w in gpu_wheels.wheels_in(wheels)}
    derived = {c.name: c.version for c in gpu_wheels.derive(device)}
    assert {k: v for k, v in on_disk.items() if k not in gpu_wheels.PROJECTS} == derived
    assert set(gpu_wheels.PROJECTS) <= set(on_disk)
    assert gpu_wheels.check(wheels, device) == []
    assert gpu_wheels.folder_bytes(ROOT / ".gpu") < gpu_wheels.SIZE_LIMIT


def test_the_check_names_a_missing_wheel(tmp_path: Path) -> None:
    for wheel in _downloaded().glob("*.whl"):
        if not wheel.name.startswith("pydantic_core-"):
            shutil.copy(wheel, tmp_path)
    problems = gpu_wheels.check(tmp_path, gpu_wheels.device_packages())
    assert any("needs pydantic-core" in p and "not in the set, not on the device" in p for p in problems), problems


def test_what_the_device_meets() -> None:
    device = {"torch": Version("2.11.0"), "pillow": None, "grpcio": None}
    assert gpu_wheels.met_by_device(Requirement("torch>=2.4"), device)
    assert not gpu_wheels.met_by_device(Requirement("torch>=2.12"), device)  # known and too old: carried
    assert gpu_wheels.met_by_device(Requirement("pillow>=10.3"), device)  # version unknown: trusted
    assert not gpu_wheels.met_by_device(Requirement("grpcio>=1.85.1"), device)  # carried anyway
    assert not gpu_wheels.met_by_device(Requirement("fastapi"), device)


def test_gpu_check_sh_parses_and_refuses_to_run_without_its_luggage(tmp_path: Path) -> None:
    script = ROOT / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {**os.environ, "GPU_DIR": str(tmp_path / "none"), "OUT": str(tmp_path)}
    proc = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "run make gpu-wheels" in proc.stderr
