"""The client package stays torch-free: only the vLLM connector (the ``[vllm]`` extra, loaded by
vLLM itself) imports torch and vllm."""

from __future__ import annotations

import subprocess
import sys

BASE_MODULES = [
    "encode_client", "encode_client.epd", "encode_client.epd_tensor", "encode_client.proxy", "encode_client.keys",
    "encode_client.store",
]


def test_base_client_imports_neither_torch_nor_vllm() -> None:
    code = (
        f"import sys; import {', '.join(BASE_MODULES)}; "
        "bad = sorted(m for m in ('torch', 'vllm', 'encode_server') if m in sys.modules); "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
