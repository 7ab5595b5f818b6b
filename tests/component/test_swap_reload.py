"""A reload in swap mode (r3090ctl reload, SIGHUP): a changed [[models]] entry restarts that engine only, a cold one
takes its new settings when the arbiter brings it in, and what needs a daemon restart is refused in one line naming
the key, with the running config kept (component: the vLLM double, the router)."""

from __future__ import annotations

import signal

import psutil

from tests.component.test_swap_daemon import BOUND, swap_rig  # noqa: F401 (a fixture)
from tests.ctl_harness import ctl
from tests.daemon_harness import api_server_pid
from tests.waiting import wait_until


def set_args(config, model_index: int, delay: str) -> None:
    """Give the model_index-th [[models]] entry its own --fake-token-delay."""
    text = config.read_text()
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("extra_args = ")][model_index]
    lines[at] = f'extra_args = ["--fake-token-delay", "{delay}"]'
    config.write_text("\n".join(lines) + "\n")


def cmdline(st: dict, rig, name: str) -> list[str]:
    return psutil.Process(api_server_pid(rig.model(st, name)["engine"]["pid"])).cmdline()


def test_a_reload_restarts_only_the_changed_models_engine_and_a_cold_one_takes_it_when_brought_in(swap_rig):  # noqa: F811
    r = swap_rig(gpu=False)
    assert r.complete("alpha").status_code == 200
    st = r.wait_model("alpha", "ready")
    alpha_pid = r.model(st, "alpha")["engine"]["pid"]

    set_args(r.config, 1, "0.011")  # beta: cold
    out = ctl(r.config, "reload")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "beta" in out.stdout, out.stdout
    st = r.proc.state()
    assert r.model(st, "alpha")["engine"]["pid"] == alpha_pid  # untouched
    assert r.complete("beta").status_code == 200  # brought in by the arbiter, with its new settings
    st = r.wait_model("beta", "ready")
    assert "0.011" in cmdline(st, r, "beta")
    beta_pid = r.model(st, "beta")["engine"]["pid"]

    set_args(r.config, 1, "0.012")  # beta: resident and ready
    out = ctl(r.config, "reload")
    assert out.returncode == 0 and "beta" in out.stdout, out.stdout + out.stderr
    st = r.proc.wait_for(lambda s: s if r.model(s, "beta")["residency"] == "ready" and r.model(s, "beta")["engine"]["pid"] not in (None, beta_pid)
                         else None, BOUND, "beta restarted with its new settings")  # fmt: skip
    assert "0.012" in cmdline(st, r, "beta")
    assert r.model(st, "alpha")["residency"] == "cold"  # the restart took no swap
    assert r.complete("beta").status_code == 200


def test_what_needs_a_daemon_restart_is_refused_in_one_line_and_sighup_applies_the_rest(swap_rig):  # noqa: F811
    r = swap_rig(gpu=False)
    assert r.complete("alpha").status_code == 200
    st = r.wait_model("alpha", "ready")
    alpha_pid = r.model(st, "alpha")["engine"]["pid"]
    original = r.config.read_text()

    alpha_model = next(line for line in original.splitlines() if line.startswith("model = "))
    r.config.write_text(original.replace("[[models]]", f'[[models]]\nname = "gamma"\n{alpha_model}\n\n[[models]]', 1))  # a model more
    out = ctl(r.config, "reload")
    assert out.returncode != 0, out.stdout + out.stderr
    error = (out.stdout + out.stderr).strip()
    assert len(error.splitlines()) == 1 and "models" in error and "systemctl restart" in error, error

    # A watchdog change alone, by SIGHUP (systemctl reload): applied, the daemon stays up, no engine restarts.
    r.config.write_text(original.replace("stall_seconds = 30.0", "stall_seconds = 31.0"))
    r.proc.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload: applied" in r.proc.log(), BOUND, what="the SIGHUP reload applied")
    assert r.proc.proc.poll() is None, r.proc.log()[-3000:]
    st = r.proc.state()
    assert r.model(st, "alpha")["engine"]["pid"] == alpha_pid and r.model(st, "alpha")["residency"] == "ready"
    assert r.complete("alpha").status_code == 200


def test_a_parked_models_changed_engine_is_stopped_and_cold_started_with_it_through_the_arbiter(swap_rig):  # noqa: F811
    r = swap_rig()  # the fake card and checkpoint driver: a swap parks the outgoing engine
    assert r.complete("alpha").status_code == 200
    r.wait_model("alpha", "ready")
    assert r.complete("beta").status_code == 200
    st = r.wait_model("alpha", "parked")
    beta_pid = r.model(st, "beta")["engine"]["pid"]

    set_args(r.config, 0, "0.013")  # alpha: parked, its engine holding the old settings
    out = ctl(r.config, "reload")
    assert out.returncode == 0 and "alpha" in out.stdout, out.stdout + out.stderr
    st = r.wait_model("alpha", "cold")
    assert r.model(st, "beta")["engine"]["pid"] == beta_pid  # the resident engine is left alone
    assert r.complete("alpha").status_code == 200  # brought in by the arbiter: a cold start, with the new settings
    st = r.wait_model("alpha", "ready")
    assert "0.013" in cmdline(st, r, "alpha")
