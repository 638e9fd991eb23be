#!/usr/bin/env bash
# The lent GPU machine's python3, as near as this machine gets to it, built once and printed (make
# gpu-rehearsal runs bench/gpu_check.sh with it).
#
# A Python 3.12 venv holding only what the server takes from the device's image
# (`scripts/gpu_wheels.py device-needs`: torch 2.11.0, torchvision 0.26.0, transformers 5.17.0 and
# the rest at the device's versions where they are known), so that bench/gpu_check.sh meets the
# same interpreter, the same torch stack and the same absences as there: a wheel missing from .gpu/
# fails here. torch and torchvision are PyPI's Linux builds, CUDA builds as on the device: about
# 3 GB of wheels (torch and the nvidia-* libraries it loads at import), downloaded once; they import
# and run on the CPU, so torchvision's decode_jpeg and transforms run here as they do there, only
# without a GPU. Cached outside the repo, keyed by the requirement list, this script and the
# interpreter; a second run is a no-op. Packages pip pulls in beyond the device's list fail the build.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${GPU_REHEARSAL_PYTHON:-$HOME/.pyenv/versions/3.12.1/bin/python}
[ -x "$python" ] || { echo "no Python 3.12 at $python (set GPU_REHEARSAL_PYTHON)" >&2; exit 1; }
needs=$(cd "$repo" && "${PYTHON:-.venv/bin/python}" scripts/gpu_wheels.py device-needs)
key=$( { echo "$needs"; cat "$repo/scripts/gpu_rehearsal_env.sh"; "$python" --version; } | sha256sum | cut -c1-12)
root=${ENCODE_SERVER_CACHE:-$HOME/.cache/encode-server}
env="$root/gpu-rehearsal-venv-$key"
mkdir -p "$root"
exec 9>"$env.lock"
flock 9
if [ ! -f "$env/.complete" ]; then
    rm -rf "$env"
    echo "building the GPU rehearsal environment in $env (about 3 GB of downloads, once)" >&2
    "$python" -m venv "$env"
    # typer 0.29 (a transformers requirement) needs pydantic, which the device lacks: its typer is older.
    # shellcheck disable=SC2086
    "$env/bin/python" -m pip install --quiet --only-binary=:all: $needs "typer<0.29" >&2
    # Nothing beyond the device's image: a package pip pulled in that the device lacks would hide a
    # wheel missing from .gpu/.
    extra=$(cd / && "$env/bin/python" -I - "$repo/bench/gpu/device-packages.txt" <<'EOF'
import sys
from importlib import metadata
from packaging.utils import canonicalize_name
device = {canonicalize_name(l.split("#")[0].split("==")[0].strip()) for l in open(sys.argv[1]) if l.split("#")[0].strip()}
have = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
print(" ".join(sorted(have - device - {"pip"})))
EOF
)
    if [ -n "$extra" ]; then
        echo "the rehearsal environment holds packages the device lacks: $extra" >&2
        exit 1
    fi
    touch "$env/.complete"
fi
echo "$env"
