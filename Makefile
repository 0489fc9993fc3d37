# The two set-up commands: `make serve` and `make test`. Both create or refresh .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: venv serve test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/canvas serve

test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check server engine kernels tests loadtest

clean:
	rm -rf $(VENV) build *.egg-info
