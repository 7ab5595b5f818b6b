"""`r3090ctl alerts test`: send one test alert on each channel, now, and say what happened.

Alertmanager gets it on each configured URL as alertname="test", severity
"info", with endsAt 5 minutes ahead: it shows, and routes, as a real alert
would, then expires by itself.

Exit codes (monitoring scheme): 0 every tested channel delivered; 2 at least one
failed; 3 no channel is enabled, so nothing could be vouched for. A broken
alerts section (unknown facility, unreadable SMTP password file, ...) is a
configuration error: 78, before anything is sent.
"""

from __future__ import annotations

import click

from r3090d import exitcodes
from r3090d.cli.common import config_option, ctl, emit_json, instance_option, load_config
from r3090d.effectors.alertformat import AlertContext
from r3090d.effectors.channels import CHANNEL_KINDS, build_channels, channel_kind, make_test_alert, send_once


@ctl.group("alerts")
def alerts_group() -> None:
    """Alert channels (syslog, email, Alertmanager)."""


@alerts_group.command("test")
@config_option
@instance_option
@click.option(
    "--channel",
    "only",
    type=click.Choice(list(CHANNEL_KINDS)),
    multiple=True,
    help="test only this channel, even if it is disabled in the config (repeatable)",
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def test(config_path, instance, only, as_json) -> int:
    """Send a test alert on every enabled channel, synchronously, one attempt each."""
    # The engine's python and model need not exist to test alerting; the SMTP
    # password is still read, from its file or systemd credential.
    cfg = load_config(config_path, instance, check_files=False)
    context = AlertContext.from_config(cfg)
    channels = build_channels(
        cfg.alerts, hostname=context.hostname, source=cfg.source, include_disabled=only
    )
    if only:
        channels = [ch for ch in channels if channel_kind(ch) in only]
    if not channels:
        if as_json:
            emit_json({"channels": [], "ok": False, "problem": "no alert channel is enabled"})
        else:
            click.echo(
                f"{cfg.source}: no alert channel is enabled "
                "(set alerts.syslog.enabled, alerts.email.enabled or alerts.alertmanager.enabled)"
            )
        return exitcodes.UNKNOWN
    raised = make_test_alert(context)
    results = []
    for channel in channels:
        if not as_json:
            click.echo(f"{channel.name} -> {channel.target}: sending test alert ... ", nl=False)
        result = send_once(channel, raised)
        results.append(result)
        if not as_json:
            outcome = "ok" if result.ok else "error"
            detail = f": {result.detail}" if result.detail else ""
            click.echo(f"{outcome}{detail} ({result.seconds:.2f} s)")
    failed = [r for r in results if not r.ok]
    if as_json:
        emit_json({"channels": [r.as_dict() for r in results], "ok": not failed})
    elif failed:
        click.echo(f"{len(failed)} of {len(results)} channels failed")
    else:
        click.echo(f"all {len(results)} channels delivered")
    return exitcodes.CRITICAL if failed else exitcodes.OK
