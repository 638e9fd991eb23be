"""The client package stays torch-free: only the vLLM connector (the ``[vllm]`` extra, loaded by
vLLM itself) imports torch and vllm."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import encode_client

# Every module of the package but the connector (vLLM loads it; the ``[vllm]`` extra), from the
# package itself, so that a new module is checked without a line here.
BASE_MODULES = ["encode_client", *sorted(
    m.name for m in pkgutil.walk_packages(encode_client.__path__, "encode_client.")
    if m.name != "encode_client.vllm_connector"
)]


def test_base_client_imports_neither_torch_nor_vllm() -> None:
    code = (
        f"import sys; import {', '.join(BASE_MODULES)}; "
        "bad = sorted(m for m in ('torch', 'vllm', 'encode_server') if m in sys.modules); "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
