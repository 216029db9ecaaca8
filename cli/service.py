"""The systemd unit that runs hermes-sup as a system service, and
`hermes-sup install-service`, which writes it for the current install.

The unit reloads: with systemd 253 or newer it is Type=notify-reload
(systemd sends SIGHUP and waits for the supervisor's RELOADING=1, then
READY=1); with an older one, Type=notify and ExecReload= sending SIGHUP. It
reads /etc/hermes-sup/config.toml (HERMES_SUP_CONFIG), which
install-service writes, commented out, if it is missing.

It is hardened as far as the workers allow; what is left off, and why, is
said in the unit. install-service warns about every path of the install
that the service could not reach (under /tmp, which PrivateTmp hides; a
directory the service user may not enter).

contrib/hermes-sup.service is the same template rendered for /opt/hermes-sup.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
import subprocess
import sys
from pathlib import Path

import click

DEFAULT_CONFIG = Path("/etc/hermes-sup/config.toml")
DEFAULT_UNIT = Path("/etc/systemd/system/hermes-sup.service")
# The first systemd with Type=notify-reload.
NOTIFY_RELOAD_SINCE = 253

UNIT = """\
# hermes-sup as a system service. Install: see `hermes-sup install-service --help`.
[Unit]
Description=hermes-sup: one process per agent session
After=network.target

[Service]
{reload}
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
# `systemctl reload hermes-sup` re-reads it (hermes-sup config check FILE first).
Environment=HERMES_SUP_CONFIG={config}
ExecStart={exec_start} serve
# Every worker and everything it started is in the service's cgroup: stopping
# the service leaves nothing behind, whatever a session did.
KillMode=control-group
KillSignal=SIGTERM
# A cgroup per session beneath the service's own (supervisor/cgroups.py):
# systemd hands the subtree over and starts the supervisor in its leaf
# <unit>/supervisor (DelegateSubgroup=, systemd 254 or newer: an older one
# ignores the line and the supervisor moves itself there).
Delegate=yes
DelegateSubgroup=supervisor
# One session's OOM kill ends that session, never the service.
OOMPolicy=continue
# The OOM killer's last choice (set by systemd before it drops to User=);
# every worker raises its own to 500.
OOMScoreAdjust=-900
TimeoutStopSec=30
WatchdogSec=30
Restart=on-failure
RestartSec=2
LimitNOFILE=65536
# Hardening (systemd-analyze security hermes-sup). Left off, for the workers'
# sake: MemoryDenyWriteExecute (JITs: Node.js, PyPy, browsers), RestrictNamespaces
# (sandboxes such as Chromium's), PrivateNetwork/IPAddressDeny (agents call
# model APIs), ProcSubset=pid (CPU and memory figures read /proc/stat),
# SystemCallFilter=~@privileged (chown, which tools a session runs may use),
# PrivateUsers (untested with the sandboxes tools bring).
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome={protect_home}
PrivateMounts=yes
PrivateTmp=yes
PrivateDevices=yes
DevicePolicy=closed
# /sys/fs/cgroup: the delegated subtree is the only part of it the service
# user owns (ProtectControlGroups= would make even that read-only).
ReadWritePaths=/var/lib/hermes-sup /run/hermes-sup /sys/fs/cgroup
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=no
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictSUIDSGID=yes
RestrictRealtime=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
LockPersonality=yes
RemoveIPC=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""

RELOAD_NOTIFY = (
    "# systemd sends SIGHUP and waits for RELOADING=1, then READY=1.\nType=notify-reload"
)
RELOAD_KILL = "Type=notify\nExecReload=/bin/kill -HUP $MAINPID"

CONFIG_TEMPLATE = """\
# hermes-sup settings (docs/configuration.md): every key may be set here;
# `systemctl reload hermes-sup` re-reads this file, `hermes-sup config check`
# checks it. Everything is commented out: the defaults apply.
#
# runtime = "probe"          # or "hermes" (needs the hermes extra)
# spare_workers = 2
# idle_timeout = 3600
# memory_limit_mb = 2048
# [agent]
# model = "..."
"""


def render(
    exec_start: str,
    user: str = "hermes-sup",
    *,
    notify_reload: bool = False,
    protect_home: str = "yes",
    config: Path = DEFAULT_CONFIG,
) -> str:
    """The unit file text for an install whose entry point is `exec_start`.
    `notify_reload` for systemd 253 and newer; `protect_home` read-only for
    an install under a home directory."""
    return UNIT.format(
        exec_start=exec_start,
        user=user,
        reload=RELOAD_NOTIFY if notify_reload else RELOAD_KILL,
        protect_home=protect_home,
        config=config,
    )


def systemd_version() -> int | None:
    """The running systemd's version, if systemctl answers."""
    try:
        out = subprocess.run(
            ["systemctl", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.match(r"systemd (\d+)", out)
    return int(found.group(1)) if found else None


# ------------------------------------------------------------------ reachability

HOMES = ("/home", "/root", "/run/user")
PRIVATE_TMP = ("/tmp", "/var/tmp")


def _under(path: Path, roots: tuple[str, ...]) -> str | None:
    for root in roots:
        if path == Path(root) or Path(root) in path.parents:
            return root
    return None


def install_paths(exec_start: str) -> list[Path]:
    """What the service must reach to start: the entry point, the
    interpreter it runs (symlinks followed) and the installed package."""
    import hermes_sup.cli

    paths = [Path(exec_start.split()[0])]
    script = paths[0]
    try:
        first = script.read_bytes()[:256].split(b"\n", 1)[0]
        if first.startswith(b"#!"):
            interpreter = Path(first[2:].decode(errors="replace").split()[0])
            paths += [interpreter, interpreter.resolve()]
    except OSError:
        pass
    paths.append(Path(sys.executable).resolve())
    paths.append(Path(hermes_sup.cli.__file__).resolve().parent)  # an editable install: the clone
    unique: list[Path] = []
    for p in paths:
        if p not in unique:
            unique.append(p)
    return unique


def _may(st: os.stat_result, uid: int | None, gids: set[int], bits: int) -> bool:
    """Whether the user (None: one we do not know, so 'other') has `bits`
    (r=4, x=1) on a file with this stat."""
    mode = stat.S_IMODE(st.st_mode)
    if uid == 0:
        return True
    if uid is not None and st.st_uid == uid:
        return mode & (bits << 6) == bits << 6
    if st.st_gid in gids:
        return mode & (bits << 3) == bits << 3
    return mode & bits == bits


def unreachable(paths: list[Path], user: str, protect_home: str) -> list[str]:
    """Why the service (as `user`, in the unit's sandbox) cannot reach each
    path it cannot reach."""
    try:
        entry = pwd.getpwnam(user)
        uid: int | None = entry.pw_uid
        gids = {entry.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
    except KeyError:
        uid, gids = None, set()
    problems = []
    for path in paths:
        tmp = _under(path, PRIVATE_TMP)
        home = _under(path, HOMES)
        if tmp:
            problems.append(f"{path} is under {tmp}, which PrivateTmp=yes hides from the service")
            continue
        if home and protect_home == "yes":
            problems.append(f"{path} is under {home}, which ProtectHome=yes hides")
            continue
        for step in [*reversed(path.parents), path]:
            try:
                st = step.stat()
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror} ({step})")
                break
            need = 1 if stat.S_ISDIR(st.st_mode) else 4
            if not _may(st, uid, gids, need):
                what = "enter" if need == 1 else "read"
                problems.append(
                    f"{path}: user {user} may not {what} {step} (mode {stat.S_IMODE(st.st_mode):o}, "
                    f"owner {st.st_uid})"
                )
                break
    return problems


# ------------------------------------------------------------------ the command


@click.command(name="install-service")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    default=DEFAULT_UNIT,
    show_default=True,
    help="Where to write the unit file; '-' for standard output.",
)
@click.option(
    "--user",
    default="hermes-sup",
    show_default=True,
    help="The dedicated user the service runs as.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_CONFIG,
    show_default=True,
    help="The settings file the service reads (and reloads); written, all commented out, "
    "if missing (when the unit goes to its default place, or this is given).",
)
def install_service(output: Path, user: str, config_file: Path) -> None:
    """Write a systemd unit (Type=notify, reloadable, hardened) for this install.

    It runs `hermes-sup serve` as a dedicated user, with sockets in
    /run/hermes-sup and sessions in /var/lib/hermes-sup (both 0700),
    KillMode=control-group so no worker outlives the service, and the
    settings in --config, which `systemctl reload hermes-sup` re-reads.
    It warns about any path of this install the service could not reach.

    \b
    Example:
      sudo hermes-sup install-service
      sudo useradd --system --no-create-home hermes-sup
      sudo systemctl daemon-reload && sudo systemctl enable --now hermes-sup
      hermes-sup install-service --output - | less    # only look at it
    """
    # Run as `python -m hermes_sup.cli`, argv[0] is a module file systemd cannot
    # exec. The interpreter is named as it was run, not resolved: a venv's
    # python finds the venv's packages, the interpreter it links to does not.
    exe = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "hermes-sup" else None
    exec_start = str(exe) if exe else f"{Path(sys.executable).absolute()} -m hermes_sup.cli"
    paths = install_paths(exec_start)
    in_home = any(_under(p, HOMES) for p in paths)
    protect_home = "read-only" if in_home else "yes"
    version = systemd_version()
    text = render(
        exec_start,
        user,
        notify_reload=version is not None and version >= NOTIFY_RELOAD_SINCE,
        protect_home=protect_home,
        config=config_file.absolute(),
    )
    for problem in unreachable(paths, user, protect_home):
        click.echo(
            f"warning: the service cannot reach {problem}; install hermes-sup where user "
            f"{user} can read it, e.g. python3 -m venv /opt/hermes-sup/.venv",
            err=True,
        )
    if str(output) == "-":
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from None
    wrote = [f"wrote {output}"]
    # The settings file goes with a unit installed in the system, or when named.
    ctx = click.get_current_context()
    installing = output == DEFAULT_UNIT or (
        ctx.get_parameter_source("config_file") is not click.core.ParameterSource.DEFAULT
    )
    if installing and not config_file.exists():
        try:
            config_file.parent.mkdir(parents=True, exist_ok=True)
            config_file.write_text(CONFIG_TEMPLATE)
            config_file.chmod(0o644)
            wrote.append(f"wrote {config_file} (every setting commented out)")
        except OSError as exc:
            raise click.ClickException(
                f"cannot write {config_file}: {exc}; the service needs it (may be empty)"
            ) from None
    click.echo(
        "\n".join(wrote) + "\nnext:\n"
        f"  useradd --system --no-create-home --shell /usr/sbin/nologin {user}\n"
        "  systemctl daemon-reload\n  systemctl enable --now hermes-sup\n"
        "  HERMES_SUP_STATE_DIR=/run/hermes-sup hermes-sup status"
    )
