# `make install`: r3090d as a system service. Included from the top-level Makefile.
#
#   make install            user r3090, venv in $(PREFIX), units, config (root)
#   make install ENGINE=1   the same, plus the vLLM venv (`make engine`)
#   make uninstall          stops and removes the units, the venv and the commands;
#                           keeps config, state, cache, the user and the vLLM venv
#
# The venv is made from Debian's /usr/bin/python3: the service user cannot see
# a pyenv python under /root (ProtectHome=yes, and /root is 0700), nor a venv
# linked to one. r3090d goes in as a built wheel, so the installed service does
# not depend on this checkout.

PREFIX ?= /opt/r3090d
INSTALL_BASE_PYTHON ?= /usr/bin/python3
UNITDIR ?= /usr/local/lib/systemd/system
CONFDIR ?= /etc/r3090d
BINDIR ?= /usr/local/bin
SERVICE_USER ?= r3090
SERVICE_GROUP ?= r3090
ENGINE ?= 0
INSTALL_WHEEL_DIR := build/install-wheel
UNITS := r3090d.service r3090d@.service

# Is systemd PID 1 here? (/run/systemd/system can outlive a systemd that ran
# in another PID namespace, so it is not proof.)
SYSTEMD_RUNNING = [ "$$(cat /proc/1/comm 2>/dev/null)" = systemd ]

.PHONY: install install-user install-venv install-units install-config uninstall

install: $(if $(filter 1 yes true,$(ENGINE)),engine) install-user install-venv install-units install-config
	@if [ ! -x "$(ENGINE_PYTHON)" ]; then \
		echo "install: note: no vLLM venv at $(ENGINE_VENV) yet: make install ENGINE=1, or set engine.python in $(CONFDIR)/r3090d.toml"; fi
	@if $(SYSTEMD_RUNNING); then \
		echo "install: systemctl daemon-reload"; systemctl daemon-reload; \
		for unit in $$(systemctl list-units --plain --no-legend --state=active 'r3090d.service' 'r3090d@*.service' | awk '{print $$1}'); do \
			echo "install: $$unit is running the old version: systemctl restart $$unit"; done; \
	else \
		echo "install: systemd is not running here; skipped daemon-reload"; fi
	@echo "install: done. Edit $(CONFDIR)/r3090d.toml, check it with '$(BINDIR)/r3090ctl config check', then:"
	@echo "           systemctl enable --now r3090d        (or r3090d@N for GPU N)"

install-user:
	@if [ "$$(id -u)" != 0 ]; then echo "install: must run as root" >&2; exit 1; fi
	@if getent group $(SERVICE_GROUP) >/dev/null; then \
		echo "install: group $(SERVICE_GROUP) exists"; \
	else \
		echo "install: creating system group $(SERVICE_GROUP)"; groupadd --system $(SERVICE_GROUP); fi
	@if getent passwd $(SERVICE_USER) >/dev/null; then \
		echo "install: user $(SERVICE_USER) exists"; \
	else \
		echo "install: creating system user $(SERVICE_USER) (no login, home /var/lib/r3090d)"; \
		useradd --system --gid $(SERVICE_GROUP) --no-create-home --home-dir /var/lib/r3090d \
			--shell /usr/sbin/nologin --comment "r3090d vLLM supervisor" $(SERVICE_USER); fi

install-venv: install-user
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
	rm -rf "$(INSTALL_WHEEL_DIR)"; \
	"$(PREFIX)/bin/python" -m pip wheel -q --no-deps -w "$(INSTALL_WHEEL_DIR)" .; \
	wheel=$$(ls "$(INSTALL_WHEEL_DIR)"/r3090d-*.whl); \
	echo "install: installing $$(basename $$wheel) and its dependencies into $(PREFIX)"; \
	"$(PREFIX)/bin/python" -m pip install -q --force-reinstall --no-deps "$$wheel"; \
	"$(PREFIX)/bin/python" -m pip install -q "$$wheel"; \
	"$(PREFIX)/bin/r3090d" --help >/dev/null; \
	for cmd in r3090d r3090ctl; do ln -sfn "$(PREFIX)/bin/$$cmd" "$(BINDIR)/$$cmd"; done; \
	echo "install: $(BINDIR)/r3090d and $(BINDIR)/r3090ctl -> $(PREFIX)/bin"

install-units: install-user
	@set -e; umask 022; install -d "$(UNITDIR)"; \
	for unit in $(UNITS); do \
		echo "install: $(UNITDIR)/$$unit"; \
		sed 's|/opt/r3090d/bin/|$(PREFIX)/bin/|' "systemd/$$unit" > "$(UNITDIR)/$$unit.new"; \
		chmod 0644 "$(UNITDIR)/$$unit.new"; mv "$(UNITDIR)/$$unit.new" "$(UNITDIR)/$$unit"; done

install-config: install-user
	@set -e; \
	install -d -m 0750 -o root -g $(SERVICE_GROUP) "$(CONFDIR)"; \
	install -D -m 0644 etc/r3090d.toml "$(PREFIX)/share/r3090d/r3090d.toml.example"; \
	if [ -e "$(CONFDIR)/r3090d.toml" ]; then \
		echo "install: keeping the existing $(CONFDIR)/r3090d.toml (the annotated reference is $(PREFIX)/share/r3090d/r3090d.toml.example)"; \
	else \
		echo "install: $(CONFDIR)/r3090d.toml from etc/r3090d.toml (root:$(SERVICE_GROUP), 0640)"; \
		install -m 0640 -o root -g $(SERVICE_GROUP) etc/r3090d.toml "$(CONFDIR)/r3090d.toml"; fi

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
	@if [ -d "$(PREFIX)" ]; then echo "uninstall: removing $(PREFIX)"; rm -rf "$(PREFIX)"; fi
	@if $(SYSTEMD_RUNNING); then echo "uninstall: systemctl daemon-reload"; systemctl daemon-reload; systemctl reset-failed 'r3090d*' 2>/dev/null || true; fi
	@echo "uninstall: kept $(CONFDIR), /var/lib/r3090d, /var/cache/r3090d, user $(SERVICE_USER) and $(ENGINE_VENV);"
	@echo "           remove them by hand if you want them gone: rm -r $(CONFDIR) /var/lib/r3090d /var/cache/r3090d $(ENGINE_VENV); userdel $(SERVICE_USER)"
