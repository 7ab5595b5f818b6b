# The project's own virtual environment, where `make demo`, `make test`,
# `make lint` and `make bench` run. Included first from the top-level Makefile.
#
# Debian's python refuses `pip install` into its own site-packages (PEP 668:
# error: externally-managed-environment), so r3090d and its extras go into a
# venv at $(VENV), made by `$(VENV_BASE_PYTHON) -m venv`. It is reused while
# pyproject.toml is unchanged and made again from nothing when it changes, so
# a dependency dropped there leaves the venv too. `make dev` makes it alone.
#
#   make test PYTHON=/path/to/python   a python you manage yourself: r3090d
#                                      is installed into it, no venv is made
#   make test VENV_BASE_PYTHON=python3.12   the venv from another python
#
# Where the venv cannot be made (Debian without python3-venv: no ensurepip),
# make stops before running anything, and says which package to install.

VENV ?= build/venv
VENV_BASE_PYTHON ?= python3
DEV_EXTRAS := test,bench,plot
# Debian's packages that `python3 -m venv` needs.
VENV_DEBS := python3 python3-venv

ifeq ($(origin PYTHON),undefined)
PYTHON := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.r3090d-dev-installed
OWN_PYTHON :=
else
DEV_STAMP := build/.dev-installed
OWN_PYTHON := yes
endif

# The goals that run $(PYTHON), so need the venv.
VENV_GOALS := dev demo demo-swap test test-fast test-e2e bench lint wheel tiny-model tiny-model-weights $(DEV_STAMP)

ifeq ($(OWN_PYTHON),)
ifneq ($(filter $(VENV_GOALS),$(MAKECMDGOALS)),)
VENV_BASE_LACKS := $(shell \
	if ! command -v "$(VENV_BASE_PYTHON)" >/dev/null 2>&1; then echo python; \
	elif ! "$(VENV_BASE_PYTHON)" -c 'import ensurepip, venv' >/dev/null 2>&1; then echo venv; fi)
ifeq ($(VENV_BASE_LACKS),python)
$(error $(VENV_BASE_PYTHON) is not found: install it with `sudo apt-get install $(VENV_DEBS)` (Debian), or give a python of your own: make $(firstword $(MAKECMDGOALS)) PYTHON=/path/to/python)
endif
ifeq ($(VENV_BASE_LACKS),venv)
$(error `$(VENV_BASE_PYTHON) -m venv` is missing (Debian's python3-venv package): install it with `sudo apt-get install python3-venv`, then run make again; or give a python of your own: make $(firstword $(MAKECMDGOALS)) PYTHON=/path/to/python)
endif
endif

$(DEV_STAMP): pyproject.toml
	@set -e; \
	if [ -e "$(VENV)" ]; then echo "dev: making $(VENV) again ($< is newer, or the last install did not finish)"; \
	else echo "dev: creating the venv $(VENV) from $(VENV_BASE_PYTHON)"; fi
	@"$(VENV_BASE_PYTHON)" -m venv --clear "$(VENV)"
	@echo "dev: installing r3090d with its extras ($(DEV_EXTRAS)) into $(VENV)"
	@$(PYTHON) -m pip install -q -e '.[$(DEV_EXTRAS)]'
	@touch $@
else
$(DEV_STAMP): pyproject.toml
	@echo "dev: installing r3090d with its extras ($(DEV_EXTRAS)) into $(PYTHON)"
	@$(PYTHON) -m pip install -q -e '.[$(DEV_EXTRAS)]'
	@mkdir -p $(dir $@) && touch $@
endif

dev: $(DEV_STAMP)
