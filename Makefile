# Two commands set everything up: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
PORT ?= 8000

.PHONY: install serve test lint bench clean proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-runs only when the project metadata changes; a second `make install` is a no-op.
$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c 'import torch' 2>/dev/null; then \
		echo "no GPU found: installing the CPU build $(TORCH_PIN) first"; \
		$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev]' -e ./clients/python
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/encode-server --host 0.0.0.0 --port $(PORT)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy encode_server clients/python/encode_client

# The gRPC code for the server and the client, from encode_server/api/proto (checked in; a test
# regenerates it and compares).
proto: install
	$(BIN)/python scripts/gen_proto.py

bench: install
	$(BIN)/python -m bench.batching

clean:
	rm -rf $(VENV) build *.egg-info
