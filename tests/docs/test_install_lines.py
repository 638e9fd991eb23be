"""Every ``pip install`` of the project in README.md and docs/ names something this repository
builds: a path of the clone or a wheel of ``make dist``, with extras its pyproject declares, never
a package index's name (the project is on none); and ``make dist`` builds both wheels, which those
lines install. (The command blocks themselves run in ``tests/integration/test_doc_blocks.py``, the
CPU-host vLLM ones in ``tests/vllm/test_doc_blocks_cpu.py``.)
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.docs.markdown import ROOT, doc_files

_PIP = re.compile(r"pip install ([^`\n]+)`")
_OWN = {"encode-client", "encode_client", "encode-server", "encode_server"}


def test_install_lines_name_the_clone_or_the_wheels_never_a_package_index() -> None:
    """``pip install`` of the project is from a clone's path or ``make dist``'s wheels, with extras
    its pyproject declares: the project is on no package index."""
    extras = {
        "./clients/python": set(tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())["project"]
                                ["optional-dependencies"]),
        ".": set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]),
    }
    extras["dist/encode_client-*.whl"] = extras["./clients/python"]
    extras["dist/encode_server-*.whl"] = extras["."]
    seen = 0
    for doc in doc_files():
        for line in _PIP.findall(doc.read_text()):
            for arg in line.split():
                target = arg.strip("'\"").replace('$(ls ', "").replace(")", "")
                name, _, extra = target.partition("[")
                if re.sub(r"[^\w-]", "", name.lower()) in _OWN or name.lower().startswith(tuple(_OWN)):
                    pytest.fail(f"{doc.name}: `pip install {line}` installs from a package index the project is not on")
                if name in extras:
                    seen += 1
                    wanted = {e for e in extra.rstrip("]").split(",") if e}
                    assert wanted <= extras[name], f"{doc.name}: `pip install {line}`: no extra {wanted - extras[name]}"
    assert seen >= 4


def test_make_dist_builds_both_wheels_and_the_documented_lines_install_them(tmp_path: Path) -> None:
    """``make dist``, then the install lines of the README and docs/, from the wheels and from
    the clone (without dependencies: what is checked is that each resolves and builds)."""
    subprocess.run(["make", "-s", "dist"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    wheels = sorted(p.name.split("-")[0] for p in (ROOT / "dist").glob("*.whl"))
    assert wheels == ["encode_client", "encode_server"]
    pip = f"{sys.executable} -m pip install --quiet --no-deps --no-build-isolation --target {tmp_path}/t"
    with (ROOT / ".venv" / ".wheel-build.lock").open("w") as lock:  # the clone's build/ folders, as make dist
        fcntl.flock(lock, fcntl.LOCK_EX)
        for line in ('"$(ls dist/encode_client-*.whl)[vllm]"', "dist/encode_server-*.whl", "'./clients/python[vllm]'"):
            subprocess.run(["bash", "-c", f"{pip} --upgrade {line}"], cwd=ROOT, check=True, timeout=300)
        shutil.rmtree(ROOT / "clients" / "python" / "build", ignore_errors=True)  # the clone's build, as make dist
    assert (tmp_path / "t" / "encode_client" / "vllm_connector.py").exists()
    assert (tmp_path / "t" / "encode_server" / "__main__.py").exists()
