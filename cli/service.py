"""The systemd unit that runs hermes-sup as a system service, and
`hermes-sup install-service`, which writes it for the current install.

contrib/hermes-sup.service is the same template rendered for /opt/hermes-sup.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

UNIT = """\
# hermes-sup as a system service. Install: see `hermes-sup install-service --help`.
[Unit]
Description=hermes-sup: one process per agent session
After=network.target

[Service]
Type=notify
NotifyAccess=main
User={user}
Group={user}
# /run/hermes-sup (sockets, key, lock) and /var/lib/hermes-sup (sessions), 0700.
RuntimeDirectory=hermes-sup
RuntimeDirectoryMode=0700
StateDirectory=hermes-sup
StateDirectoryMode=0700
UMask=0077
Environment=HERMES_SUP_STATE_DIR=/run/hermes-sup
Environment=HERMES_SUP_DATA_DIR=/var/lib/hermes-sup
ExecStart={exec_start} serve
# Every worker and everything it started is in the service's cgroup: stopping
# the service leaves nothing behind, whatever a session did.
KillMode=control-group
KillSignal=SIGTERM
TimeoutStopSec=30
WatchdogSec=30
Restart=on-failure
RestartSec=2
LimitNOFILE=65536
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
ReadWritePaths=/var/lib/hermes-sup /run/hermes-sup
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
"""


def render(exec_start: str, user: str = "hermes-sup") -> str:
    """The unit file text for an install whose entry point is `exec_start`."""
    return UNIT.format(exec_start=exec_start, user=user)


@click.command(name="install-service")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("/etc/systemd/system/hermes-sup.service"),
    show_default=True,
    help="Where to write the unit file.",
)
@click.option(
    "--user",
    default="hermes-sup",
    show_default=True,
    help="The dedicated user the service runs as.",
)
def install_service(output: Path, user: str) -> None:
    """Write a systemd unit (Type=notify, hardened) for this install.

    It runs `hermes-sup serve` as a dedicated user, with sockets in
    /run/hermes-sup and sessions in /var/lib/hermes-sup (both 0700), and
    KillMode=control-group so no worker outlives the service.

    \b
    Example:
      sudo hermes-sup install-service
      sudo useradd --system --no-create-home hermes-sup
      sudo systemctl daemon-reload && sudo systemctl enable --now hermes-sup
    """
    # Run as `python -m hermes_sup.cli`, argv[0] is a module file systemd cannot exec.
    exe = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "hermes-sup" else None
    exec_start = str(exe) if exe else f"{Path(sys.executable).resolve()} -m hermes_sup.cli"
    try:
        output.write_text(render(exec_start, user))
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from None
    click.echo(
        f"wrote {output}\nnext:\n"
        f"  useradd --system --no-create-home --shell /usr/sbin/nologin {user}\n"
        "  systemctl daemon-reload\n  systemctl enable --now hermes-sup\n"
        "  HERMES_SUP_STATE_DIR=/run/hermes-sup hermes-sup status"
    )
