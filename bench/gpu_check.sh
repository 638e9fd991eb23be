#!/usr/bin/env bash
# S1 and S2 on a GPU with a Qwen2.5-VL-7B-sized vision tower (random weights, bf16); under 8 minutes.
# Needs a CUDA build of torch in .venv (make install picks it when nvidia-smi is present), redis-server.
# Usage: bench/gpu_check.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")'
command -v redis-server >/dev/null || { echo "redis-server missing: apt-get install -y redis-server" >&2; exit 1; }
exec timeout 480 "$PY" -m bench.gpu_check "$@"
