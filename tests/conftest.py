"""tests/vllm need vLLM, which lives in its own environment: `make test-vllm` (part of `make test`)
runs them there; the server's venv, which has no vLLM, leaves them out."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
