"""tests/vllm need vLLM, which lives in its own environment: `make test-vllm` (part of `make test`)
runs them there; the server's venv, which has no vLLM, leaves them out. tests/gpu need torchvision
(the batched preprocessing path): `make test-gpu-path` runs them in the GPU rehearsal environment."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
if importlib.util.find_spec("torchvision") is None:
    collect_ignore.append("gpu")
