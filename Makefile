# Two commands set everything up: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
PORT ?= 8000

.PHONY: install serve test lint bench clean redis-binaries

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

# The Redis tests start their own redis-server processes: never skip them silently. As root with
# apt-get, install the package; otherwise stop and say how.
redis-binaries:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && apt-get install -y -qq redis-server; \
		else \
			echo "redis-server and redis-cli are needed by the tests; install them: apt-get install -y redis-server" >&2; \
			exit 1; \
		fi; \
	fi

test: install redis-binaries
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy encode_server

bench: install redis-binaries
	$(BIN)/python -m bench.batching
	$(BIN)/python -m bench.tiers

clean:
	rm -rf $(VENV) build *.egg-info
