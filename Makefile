# Two commands set everything up: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch release the project is tested with lives in deploy/torch.txt, which the Dockerfile reads too.
TORCH_REQ := deploy/torch.txt
# make serve's two ports, on 0.0.0.0 (all interfaces): HTTP and gRPC; GRPC_PORT=0 turns gRPC off.
# The server's own variables, when set, are their defaults (a flag would override them).
PORT ?= $(or $(ENCODE_SERVER_PORT),8000)
GRPC_PORT ?= $(or $(ENCODE_SERVER_GRPC_PORT),50051)

.PHONY: install tools serve test test-quick test-container test-vllm vllm-env test-sglang sglang-env lint bench bench-epd bench-tower-memory soak clean proto openapi \
	docs test-docs gpu-wheels gpu-rehearsal test-lane-server test-lane-vllm demo-epd checkpoint dist

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# setuptools says "Editable installation." once per editable package (an InformationOnly warning:
# a folder named like the package in the working directory may shadow it), which pip prints even
# with --quiet: nothing to act on, so not shown (tests/docs/test_make_targets.py holds it to setuptools).
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation:UserWarning"

# Re-runs only when the project metadata changes; a second `make install` is a no-op.
$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml $(TORCH_REQ)
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c 'import torch' 2>/dev/null; then \
		echo "no GPU found: installing the CPU build of $$(grep -v '^#' $(TORCH_REQ)) first"; \
		$(BIN)/python -m pip install --quiet -r $(TORCH_REQ); \
	fi
	$(EDITABLE_QUIET) $(BIN)/python -m pip install --quiet -e '.[dev]' -e './clients/python[store,proxy]'
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/encode-server --host 0.0.0.0 --port $(PORT) --grpc-port $(GRPC_PORT)

# Binaries the tests run (never skipped silently): redis-server/redis-cli (fault and cluster tests
# start their own), Debian's promtool and prometheus, docker-compose (validates deploy/), b3sum
# (the client's `hash` must print what it prints). Installed here when missing (root with apt),
# else make stops with the command to run. podman, runc and debootstrap build and run the image in
# test-container (runc: crun refuses these hosts' hybrid cgroup layout).
OPS_TOOLS := redis-server redis-cli promtool prometheus docker-compose b3sum podman runc debootstrap
OPS_PACKAGES := redis-server prometheus docker-compose b3sum podman runc debootstrap

tools:
	@missing=$$(for t in $(OPS_TOOLS); do command -v $$t >/dev/null || echo $$t; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing $(OPS_PACKAGES) for: $$missing"; \
			apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $(OPS_PACKAGES) >/dev/null; \
		else \
			echo "missing: $$missing. Install them, then re-run: sudo apt-get install -y $(OPS_PACKAGES)" >&2; exit 1; \
		fi; \
	fi

# Every suite prints its 30 slowest tests, setups and teardowns (where a fixture starts a process),
# and the start-up seconds of every process it started (tests/startups.py).
DURATIONS ?= --durations=30

# The whole suite, in two lanes side by side: one lane alone left about 40% of the two cores idle
# (most of a suite's time is processes starting). The server's lane: ruff, mypy, the server's suite, the
# container. vLLM's lane: its environment (minutes on a fresh machine, mostly downloads), the vLLM
# suite, the GPU check rehearsed. Each lane takes ports from a range of its own (tests/server.py), and
# prints its output whole when it ends (make -O); `make test` fails when either lane does.
test: install tools
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-lane-server test-lane-vllm

test-lane-server: install tools
	$(BIN)/ruff check .
	$(BIN)/mypy encode_server clients/python/encode_client
	ENCODE_SERVER_TEST_LANE=0 $(BIN)/python -m pytest -q $(DURATIONS) --ignore=tests/container
	@ENCODE_SERVER_TEST_LANE=0 $(MAKE) --no-print-directory test-container

test-lane-vllm: install tools gpu-wheels
	@ENCODE_SERVER_TEST_LANE=1 $(MAKE) --no-print-directory test-vllm
	@ENCODE_SERVER_TEST_LANE=1 $(MAKE) --no-print-directory test-sglang
	@ENCODE_SERVER_TEST_LANE=1 $(MAKE) --no-print-directory gpu-rehearsal

# The quick tier, for working between full runs (about 2 minutes on the 2-core machine): ruff, the
# unit, docs and deploy tests, and the integration tests of the two front doors and the limits
# (one server each). Not a substitute for `make test`, which is what CI runs and what lands.
QUICK_TESTS := tests/unit tests/docs tests/deploy tests/integration/test_encode_api.py \
	tests/integration/test_grpc_and_tokens.py tests/integration/test_limits.py

test-quick: install tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(DURATIONS) $(QUICK_TESTS)

# Builds the CPU image with podman (layers and the stand-in base image cached under
# ~/.cache/encode-server/podman; only the code layer is rebuilt when the code changes) and runs it:
# /ready, an encode and a Redis hit, non-root, HEALTHCHECK on a non-default port, SIGTERM drain,
# read-only root. See tests/container/.
test-container: install tools
	$(BIN)/python -m pytest -q tests/container

# vLLM's CPU build in its own venv, cached outside the repo under ~/.cache/encode-server and keyed by
# a hash of tests/vllm/env (built once, in a few minutes; see scripts/vllm_env.sh); its path on
# stdout. The tests run a real vLLM engine in-process against a real encode-server (from .venv) and
# a real Redis; `make demo-epd` runs the whole EPD stack with it.
vllm-env:
	@scripts/vllm_env.sh

# The whole EPD stack on this machine, CPU only (scripts/demo_epd.py): the vLLM CPU env, the tiny
# Qwen2.5-VL checkpoint, Redis (127.0.0.1:6379's, else its own), encode-server, a tower-free vLLM
# with the connector and encode-epd-proxy on 127.0.0.1:8080 (DEMO_PORT=...); prints a curl and an OpenAI
# snippet to try; Ctrl-C stops it all.
DEMO_PORT ?= 8080

demo-epd: install
	@env=$$(scripts/vllm_env.sh) && \
	ENCODE_SERVER_PYTHON=$(abspath $(BIN))/python PYTHONPATH=$(CURDIR)/clients/python:$(CURDIR) \
	exec "$$env/bin/python" -m scripts.demo_epd --port $(DEMO_PORT)

# The small seeded checkpoint a family's tests build (scripts/tiny_checkpoint.py; random weights,
# nothing downloaded): `make checkpoint DIR=/tmp/tiny-qwen [FAMILY=qwen2_vl]`; FAMILY=list lists them.
FAMILY ?= qwen2_vl

checkpoint: install
	@if [ "$(FAMILY)" = list ]; then $(BIN)/python -m scripts.tiny_checkpoint --list; \
	elif [ -z "$(DIR)" ]; then echo "usage: make checkpoint DIR=path [FAMILY=name] (FAMILY=list: the families)" >&2; exit 2; \
	else $(BIN)/python -m scripts.tiny_checkpoint "$(DIR)" --family "$(FAMILY)"; fi

# The server's and the client's wheels, into dist/ (pip install dist/encode_server-*.whl, and the
# client's with its extras: pip install "$(ls dist/encode_client-*.whl)[vllm]"), as make gpu-wheels
# builds them (scripts/gpu_wheels.py: pip wheel, no dependencies, one build at a time).
dist: install
	@rm -rf dist && $(BIN)/python scripts/gpu_wheels.py project --dir dist && ls dist/*.whl

test-vllm: install tools
	@env=$$(scripts/vllm_env.sh) && \
	ENCODE_SERVER_PYTHON=$(abspath $(BIN))/python PYTHONPATH=$(CURDIR)/clients/python:$(CURDIR) \
	"$$env/bin/python" -m pytest -q -p no:cacheprovider $(DURATIONS) tests/vllm

# SGLang 0.5.23's receiving side (its language-only prefill's MMReceiverHTTP, allow-list unpickler and
# processors; no model) in its own venv, cached outside the repo under ~/.cache/encode-server and keyed
# by a hash of tests/sglang/env (built once, in about 2 minutes; see scripts/sglang_env.sh); its path on
# stdout. The tests drive it against real encode-servers (from .venv) over HTTP and ZMQ, and a real Redis.
sglang-env:
	@scripts/sglang_env.sh

test-sglang: install tools
	@env=$$(scripts/sglang_env.sh) && \
	ENCODE_SERVER_PYTHON=$(abspath $(BIN))/python PYTHONPATH=$(CURDIR)/clients/python:$(CURDIR) \
	"$$env/bin/python" -m pytest -q -p no:cacheprovider $(DURATIONS) tests/sglang

# The GPU check's luggage (bench/gpu_check.sh on the lent GPU machine, which reaches no registry):
# the wheels its python3 (3.12) lacks, derived from the pyproject files against
# bench/gpu/device-packages.txt, at the versions .venv holds, for cp312 manylinux x86_64; the
# project's own two wheels; redis-server's .deb files. Into .gpu/ (ignored; the run tool carries
# it: under 64 MiB, printed). A second run downloads nothing and rebuilds only the project's wheels.
gpu-wheels: install
	@$(BIN)/python scripts/gpu_wheels.py download

# The GPU check rehearsed end to end (part of `make test`, about 2 minutes; 3 GB downloaded once):
# bench/gpu_check.sh as the GPU machine runs it, with a stand-in for that machine's python3
# (scripts/gpu_rehearsal_env.sh: Python 3.12 with its torch 2.11, torchvision 0.26 and transformers
# 5.17, PyPI's CUDA builds, which run on the CPU; nothing else), the same .gpu/ installed the same
# way: a dry run, then the measurements with --device cpu and shrunken towers, then tests/gpu (the
# batched preprocessing path against the CPU path). Figures under .gpu-rehearsal/ (ignored).
GPU_REHEARSAL_OUT ?= $(CURDIR)/.gpu-rehearsal

gpu-rehearsal: gpu-wheels
	@env=$$(scripts/gpu_rehearsal_env.sh) && mkdir -p $(GPU_REHEARSAL_OUT) && \
	PYTHON="$$env/bin/python" OUT=$(GPU_REHEARSAL_OUT) bench/gpu_check.sh --dry-run && \
	PYTHON="$$env/bin/python" OUT=$(GPU_REHEARSAL_OUT) bench/gpu_check.sh --device cpu --rehearsal

# The generated parts of the docs: the flag table of docs/operations.md, from the settings object
# (a test fails when the page differs from what this writes).
docs: install
	$(BIN)/python scripts/gen_docs.py

# The docs against the code (part of `make test`, through pytest's testpaths): every link
# resolves, every error type and metric is documented, docs/openapi.json is what a server serves.
test-docs: install
	$(BIN)/python -m pytest -q tests/docs

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy encode_server clients/python/encode_client

# The gRPC code for the server and the client, from encode_server/api/proto (checked in; a test
# regenerates it and compares).
proto: install
	$(BIN)/python scripts/gen_proto.py

# docs/openapi.json, from the app factory (a test fails when it differs from what the server serves).
openapi: install
	$(BIN)/python scripts/export_openapi.py

# Each tower's warm forward counted (bench/tower_ops.py: aten ops, attention calls, host syncs per
# family, CPU images/s), then the serving path's own ceiling (bench/ceiling.py: builtin:zero through
# each door, CPU and GIL ms per request, beside the bare pipeline), then the side-by-side figures
# (bench/results/latest.json and PNGs; S4 reuses bench/tiers.py), then encode-server against vLLM's own encoder instance (its keys
# merged into latest.json; builds the vLLM environment first when missing), then the request-memory burst, then the latency
# encode-epd-proxy adds against vLLM directly (64 concurrent streaming chats), then what a video
# costs (bench/video.py: seconds of encode per second of video, its stages), then what an audio file
# costs (bench/audio.py: seconds of encode per second of audio, its stages). The older benches run
# alone: python -m bench.batching, python -m bench.tiers. A GPU: bench/gpu_check.sh (make gpu-wheels
# first; make gpu-rehearsal here).
bench: install tools
	$(BIN)/python -m bench.tower_ops
	$(BIN)/python -m bench.ceiling
	$(BIN)/python -m bench.serving
	$(BIN)/python -m bench.vllm_peer
	$(BIN)/python -m bench.memory_burst
	$(BIN)/python -m bench.proxy
	$(BIN)/python -m bench.video
	$(BIN)/python -m bench.audio

# EPD as its users see it: first the EPD proxy's own CPU per request by stage (bench/proxy_cpu.py,
# a minute, no vLLM: the epd_cpu_ms_proxy_* keys), then (bench/epd_system.py) vLLM's own `vllm bench
# serve` against three stacks (aggregated vLLM, vLLM's own EPD, encode-server's EPD), R = 1 and 2
# replicas, three workloads, two models; about 30 minutes on 2 cores, alone on the machine. Writes
# bench/results/latest.json's sys_* keys and bench/results/epd_system.png; docs/benchmarks.md has the runs.
bench-epd: install tools vllm-env
	$(BIN)/python -m bench.proxy_cpu
	$(BIN)/python -m bench.epd_system

# What a tower-free vLLM prefill frees (docs/vllm.md, "The memory it frees"): two vLLM engines, one
# at a time, with --load-format dummy on a Qwen2.5-VL-3B-sized config, then two on a
# Qwen2-Audio-7B-sized one (its audio tower); needs ~10 and ~13 GiB free, checked.
bench-tower-memory: install tools
	$(BIN)/python -m bench.tower_memory
	$(BIN)/python -m bench.tower_memory --case qwen2_audio_7b
	$(BIN)/python -m bench.tower_memory --case qwen2_5_omni_7b

# 10 minutes of mixed load with Redis paused once (the figures in docs/robustness.md); the tests
# run its 60-second form.
soak: install tools
	$(BIN)/python -m bench.soak --duration 600

clean:
	rm -rf $(VENV) build dist *.egg-info
