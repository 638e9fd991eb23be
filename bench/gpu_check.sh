#!/usr/bin/env bash
# The GPU check, as it runs on the lent GPU machine (no registry there): the wheel set and the
# redis-server .deb files that `make gpu-wheels` put in .gpu/, installed into a temporary site and
# folder; the server run by the machine's own python3 (its torch, torchvision, transformers) with
# PYTHONPATH; bench/gpu_check.py's measurements; then tests/gpu on the device. Under 6 minutes on
# an H200 (hard timeouts inside). Writes gpu.json, gpu.md (the table), gpu_check.log and
# tests_gpu.log under $OUT (and, on a GPU, bench/results/gpu.json).
#
# On the lent machine, from the repository root:   bench/gpu_check.sh
#   (the run tool: carry [".gpu"], command "bench/gpu_check.sh", timeout_s 420)
# Rehearsed here:                                   make gpu-rehearsal   (--device cpu --rehearsal)
# Only install and check the wheels and redis:      bench/gpu_check.sh --dry-run
#
# PYTHON: the interpreter (default python3); GPU_DIR: the carried folder (default .gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-python3}
GPU_DIR=${GPU_DIR:-.gpu}
OUT=${OUT:-$repo/bench/results}
mkdir -p "$OUT"
dry=0 args=()
for a in "$@"; do
    if [ "$a" = --dry-run ]; then dry=1; else args+=("$a"); fi
done
started=$SECONDS
say() { echo "[$((SECONDS - started)) s] $*"; }
fail() { echo "gpu_check: $*" >&2; exit 1; }

[ -d "$GPU_DIR/wheels" ] && [ -d "$GPU_DIR/deb" ] || fail "no $GPU_DIR/wheels or $GPU_DIR/deb: run make gpu-wheels here first"
work=$(mktemp -d /tmp/encode-gpu-check.XXXXXX)
trap 'rm -rf "$work"' EXIT

# 1. The wheel set into a temporary site, ahead of the machine's own packages.
say "installing $(ls "$GPU_DIR"/wheels/*.whl | wc -l) wheels into $work/site"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$work/site" "$GPU_DIR"/wheels/*.whl || fail "pip could not install the wheel set"
# The checkout first (its code is what the wheels were built from), then the wheels.
export PYTHONPATH="$repo:$work/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$work/site/bin:$PATH"  # the carried wheels' executables (py-spy, for the ceiling's GIL figures)
"$PY" scripts/gpu_wheels.py import-check --site "$work/site" || fail "a carried wheel does not import"

# 2. redis-server from the .deb files, its own libraries beside it (not on everyone's path).
for deb in "$GPU_DIR"/deb/*.deb; do dpkg -x "$deb" "$work/redis" || fail "dpkg -x $deb"; done
mkdir -p "$work/bin"
libs="$work/redis/usr/lib/x86_64-linux-gnu:$work/redis/lib/x86_64-linux-gnu"
for tool in redis-server redis-cli; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
        "$libs" "$work/redis/usr/bin/$tool" > "$work/bin/$tool"
    chmod +x "$work/bin/$tool"
done
export PATH="$work/bin:$PATH"
redis_ok=1
if ! redis-server --version; then
    redis_ok=0
    echo "redis-server does not run here; its libraries:" >&2
    LD_LIBRARY_PATH=$libs ldd "$work/redis/usr/bin/redis-check-rdb" >&2 || true
fi
if [ $redis_ok = 1 ]; then
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$work/redis.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 50); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
    redis-cli -p "$port" ping | grep -q PONG || redis_ok=0
    kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null
fi
[ $redis_ok = 1 ] && say "redis-server runs from the .deb files" || echo "redis-server failed: S2 will fail" >&2
if [ $dry = 1 ]; then
    [ $redis_ok = 1 ] || fail "redis-server from the .deb files does not run"
    say "dry run: wheels install and import, redis-server runs"
    exit 0
fi

# 3. Every requirement met (the machine's packages and the wheels), before any server starts.
"$PY" scripts/gpu_wheels.py verify-env || fail "requirements unmet (above): add the package to the wheel set"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 4. The measurements (bench/gpu_check.py writes after every stage), then tests/gpu with the time left.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ENCODE_SERVER_CACHE="$work/cache"
device=cuda
for a in "${args[@]}"; do [ "$a" = cpu ] && device=cpu; done
say "measuring"
timeout -k 10 300 "$PY" -m bench.gpu_check --out "$OUT/gpu.json" "${args[@]}" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
# A GPU's figures also where the repository keeps them (a rehearsal's never overwrite those).
[ $device = cuda ] && ! [ "$OUT/gpu.json" -ef bench/results/gpu.json ] && cp "$OUT/gpu.json" bench/results/gpu.json
left=$((330 - (SECONDS - started)))
if [ $left -gt 30 ]; then
    say "tests/gpu on $device, $left s left"
    timeout -k 5 "$left" "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -25 | tee "$OUT/tests_gpu.log"
    trc=${PIPESTATUS[0]}
else
    trc=124
    echo "no time left for tests/gpu" | tee "$OUT/tests_gpu.log"
fi
say "done: measurements exit $rc, tests/gpu exit $trc"
[ $rc = 0 ] && [ $trc = 0 ]
