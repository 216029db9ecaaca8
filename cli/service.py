"""The systemd unit that runs hermes-sup as a system service.

`hermes-sup install-service` renders it for the current install;
contrib/hermes-sup.service is the same template rendered for /opt/hermes-sup.
"""

from __future__ import annotations

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
