#!/usr/bin/env bash
# Build the SGLang test environment once and print its path (make sglang-env; make test-sglang uses it).
#
# Cached outside the repo, keyed by a hash of what defines it (requirements, the torchvision shim,
# this script, the Python version): a second run is a no-op; a change builds a fresh one beside the old.
# The project's own code (server, client) is never installed here: tests put it on PYTHONPATH.
#
# What it holds: SGLang 0.5.23's receiving side (the wheel installed with --no-deps: its own requirements
# pin a CUDA torch 2.14.1 and CUDA-only kernels that a CPU never loads) and what that side imports, pinned
# in tests/sglang/env/requirements.txt. torch is the server's CPU build (2.13.0, not SGLang's 2.14.1);
# torchvision, which sglang imports at start, is PyPI's CUDA build made importable by the vLLM
# environment's shim (tests/vllm/env/torchvision_cpu_shim.py, see its docstring), installed by a .pth line.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
reqs="$repo/tests/sglang/env/requirements.txt"
shim="$repo/tests/vllm/env/torchvision_cpu_shim.py"
sglang=sglang==0.5.23
python=${PYTHON:-python3}
key=$( { cat "$reqs" "$shim" "$repo/scripts/sglang_env.sh"; "$python" --version; } | sha256sum | cut -c1-12)
root=${ENCODE_SERVER_CACHE:-$HOME/.cache/encode-server}
env="$root/sglang-venv-$key"
mkdir -p "$root"
exec 9>"$env.lock"
flock 9  # one build at a time; a second caller waits, then finds it done
if [ ! -f "$env/.complete" ]; then
    rm -rf "$env"
    echo "building the SGLang test environment in $env (a few minutes, once)" >&2
    started=$SECONDS
    "$python" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip >&2
    "$env/bin/python" -m pip install --quiet -r "$reqs" >&2
    "$env/bin/python" -m pip install --quiet --no-deps "$sglang" >&2
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp "$shim" "$site/"
    echo "import torchvision_cpu_shim; torchvision_cpu_shim.install()" > "$site/torchvision_cpu_shim.pth"
    # The receiver, the allow-list unpickler, the tokenizer manager and Qwen-VL's processor (which the receiver builds) import.
    "$env/bin/python" -W ignore -c 'import sglang, sglang.srt.disaggregation.encoder.receiver as r, sglang.srt.multimodal.processors.qwen_vl as q, sglang.srt.managers.tokenizer_manager; from sglang.srt.utils.common import safe_pickle_loads; assert sglang.__version__ == "0.5.23", sglang.__version__; print(r.EmbeddingData, q.QwenVLImageProcessor)' >/dev/null
    touch "$env/.complete"
    echo "built the SGLang test environment in $((SECONDS - started)) s ($(du -sh "$env" | cut -f1))" >&2
fi
echo "$env"
