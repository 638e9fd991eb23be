# Two commands set everything up: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
PORT ?= 8000

.PHONY: install tools serve test lint bench soak clean proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-runs only when the project metadata changes; a second `make install` is a no-op.
$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c 'import torch' 2>/dev/null; then \
		echo "no GPU found: installing the CPU build $(TORCH_PIN) first"; \
		$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev]' -e './clients/python[store]'
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/encode-server --host 0.0.0.0 --port $(PORT)

# Binaries the tests run (never skipped silently): redis-server/redis-cli (fault and cluster tests
# start their own), Debian's promtool and prometheus, docker-compose (validates deploy/), b3sum
# (the client's `hash` must print what it prints). Installed here when missing (root with apt),
# else make stops with the command to run.
OPS_TOOLS := redis-server redis-cli promtool prometheus docker-compose b3sum
OPS_PACKAGES := redis-server prometheus docker-compose b3sum

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

test: install tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy encode_server clients/python/encode_client

# The gRPC code for the server and the client, from encode_server/api/proto (checked in; a test
# regenerates it and compares).
proto: install
	$(BIN)/python scripts/gen_proto.py

bench: install tools
	$(BIN)/python -m bench.batching
	$(BIN)/python -m bench.tiers

# 10 minutes of mixed load with Redis paused once (the README's Robustness figures); the tests
# run its 60-second form.
soak: install tools
	$(BIN)/python -m bench.soak --duration 600

clean:
	rm -rf $(VENV) build *.egg-info
