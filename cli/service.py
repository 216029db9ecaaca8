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
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

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
{secrets}ExecStart={exec_start} serve
# Every worker and everything it started is in the service's cgroup: stopping
# the service leaves nothing behind, whatever a session did.
KillMode=control-group
KillSignal=SIGTERM
# A cgroup per session beneath the service's own (supervisor/cgroups.py):
# systemd hands the subtree over and starts the supervisor in its leaf
# <unit>/supervisor (DelegateSubgroup=, systemd 254 or newer: an older one
# ignores the line and the supervisor moves itself there).
Delegate=yes
{delegate_subgroup}# One session's OOM kill ends that session, never the service.
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
# The first systemd that knows DelegateSubgroup= (an older one warns and ignores it).
DELEGATE_SUBGROUP_SINCE = 254
DELEGATE_SUBGROUP = "DelegateSubgroup=supervisor\n"
# Secrets the supervisor reads (the model key, as api_key_env names it):
# systemd reads the file as root before it drops to User=, so it stays
# root's and 0600, and only the supervisor's environment holds the key
# (never a worker's: DEFAULT_PASS_ENV does not pass it on).
SECRETS = """\
# The model key and any other secret of the supervisor's: NAME=value lines,
# read by systemd as root (keep the file root's, 0600).
EnvironmentFile={env_file}
"""

CONFIG_TEMPLATE = """\
# hermes-sup settings (docs/configuration.md): every key may be set here;
# `systemctl reload hermes-sup` re-reads this file, `hermes-sup config check`
# checks it. What is commented out is at its default.
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
    env_file: Path | None = None,
    delegate_subgroup: bool = True,
) -> str:
    """The unit file text for an install whose entry point is `exec_start`.
    `notify_reload` for systemd 253 and newer; `protect_home` read-only for
    an install under a home directory; `env_file` the secrets
    the supervisor reads; `delegate_subgroup` for systemd 254 and newer."""
    return UNIT.format(
        exec_start=exec_start,
        user=user,
        reload=RELOAD_NOTIFY if notify_reload else RELOAD_KILL,
        protect_home=protect_home,
        config=config,
        secrets=SECRETS.format(env_file=env_file) if env_file is not None else "",
        delegate_subgroup=DELEGATE_SUBGROUP if delegate_subgroup else "",
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


# ------------------------------------------------------------------ Hermes behind HTTP


def under(root: Path, path: Path) -> Path:
    """`path` (absolute) as it lies under `root`: itself when root is /."""
    path = path.absolute()
    return path if root == Path("/") else root / path.relative_to("/")


def env_file_names(path: Path) -> set[str]:
    """The variable names an EnvironmentFile= sets (NAME=value lines; # and ;
    start comments, as systemd reads it); the values are never kept."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        name = line.split("=", 1)[0].strip()
        names.add(name.removeprefix("export ").strip())
    return names


def _toml_value(value: Any) -> str:
    """A scalar of the agent config as TOML (a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int | float) else json.dumps(str(value))


def service_settings(
    agent: str | None,
    agent_config: Path | None,
    http_listen: str | None,
    env_file: Path | None,
    http_key: str | None,
) -> list[str]:
    """The settings file's lines for what was asked (the runtime, the
    endpoint, the agent's table), each checked now as serve would check it
    at start, so a mistake shows here and not as a service that will not
    start. In the file, not on the unit's command line: there they would
    beat the file, and an operator's later edit of it would do nothing."""
    import importlib.util

    from hermes_sup.local.addresses import parse_listen
    from hermes_sup.local.version import install_hint
    from hermes_sup.supervisor.configfile import ConfigError, load_agent_config

    from .configcheck import check_runtime

    lines: list[str] = []
    if agent is not None:
        problem = check_runtime(agent)
        if problem is not None:
            raise click.ClickException(f"--agent {agent}: {problem}")
        lines.append(f"runtime = {_toml_value(agent)}")
    if env_file is not None:
        if not env_file.is_file():
            raise click.BadParameter(
                f"{env_file} does not exist: write the model key into it as NAME=value "
                "(root's, chmod 600) first",
                param_hint="--env-file",
            )
        if env_file.stat().st_mode & 0o077:
            click.echo(f"warning: {env_file} is readable by others; chmod 600 it", err=True)
    if agent_config is not None:
        # api_key_env names a variable of the env file: the service has it, we may not.
        names = env_file_names(env_file) if env_file is not None else set()
        try:
            load_agent_config(agent_config, {**os.environ, **dict.fromkeys(names, "set")})
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--agent-config") from None
        # The table as the operator wrote it (the key's variable, never the key):
        # read as load_agent_config read it a line above, so it cannot fail.
        text = agent_config.read_text()
        raw = json.loads(text) if agent_config.suffix == ".json" else tomllib.loads(text)
        agent_table = ["", "[agent]", *(f"{k} = {_toml_value(v)}" for k, v in raw.items())]
    if http_listen is not None:
        try:
            parse_listen(http_listen, "--http")
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--http") from None
        if importlib.util.find_spec("uvicorn") is None:
            raise click.ClickException(
                "--http needs starlette and uvicorn (the http extra): " + install_hint("http")
            )
        lines.append(f"http = {_toml_value(http_listen)}")
    elif http_key is not None:
        raise click.BadParameter("an HTTP key is for --http: give it too", param_hint="--http-key")
    return lines + (agent_table if agent_config is not None else [])


def make_http_key(root: Path, name: str, user: str) -> str:
    """Make the HTTP key `name` in the service's data directory, owned by
    the service user where that user exists (else systemd's StateDirectory=
    gives it over at the first start), and write the key itself where only
    root reads it. What was done, as a line for the operator."""
    from hermes_sup.httpapi.keys import KeyFileError, KeyStore

    data_dir = under(root, Path("/var/lib/hermes-sup"))
    secret = under(root, Path(f"/etc/hermes-sup/http-key-{name}"))
    try:
        key = KeyStore(data_dir).generate(name)
    except KeyFileError as exc:
        raise click.ClickException(str(exc)) from None
    secret.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        owner = f"user {user} does not exist yet: systemd gives it the data directory at start"
    else:
        for path in [data_dir, *data_dir.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
        owner = f"owned by {user}"
    return f"made the HTTP key {name} in {data_dir} ({owner}); the key is in {secret} (0600)"


def warn_unreachable(
    paths: list[Path], agent_config: Path | None, user: str, protect_home: str
) -> None:
    """Say which of the install's files the service could not reach."""
    for problem in unreachable(paths, user, protect_home):
        click.echo(
            f"warning: the service cannot reach {problem}; install hermes-sup where user "
            f"{user} can read it, e.g. python3 -m venv /opt/hermes-sup/.venv",
            err=True,
        )
    for problem in unreachable(
        [agent_config.absolute()] if agent_config else [], user, protect_home
    ):
        click.echo(
            f"warning: the service cannot read {problem}; put the agent config where user "
            f"{user} can read it, e.g. /etc/hermes-sup/agent.toml (mode 644: it names the "
            "model key's variable, never the key)",
            err=True,
        )


def write_config(path: Path, settings: list[str]) -> str:
    """Write the settings file: every key commented out, then the settings
    install-service was given. What was done, as a line for the operator."""
    given = "".join(f"{line}\n" for line in settings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            CONFIG_TEMPLATE + (f"\n# Given to install-service:\n{given}" if given else "")
        )
        path.chmod(0o644)
    except OSError as exc:
        raise click.ClickException(
            f"cannot write {path}: {exc}; the service needs it (may be empty)"
        ) from None
    return (
        f"wrote {path} ({'with the settings given' if settings else 'every setting commented out'})"
    )


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
@click.option(
    "--agent",
    type=click.Choice(["probe", "hermes"]),
    default=None,
    help="The agent runtime the service runs (default: the config file's, else probe).",
)
@click.option(
    "--agent-config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The agent's settings (agent.toml: model, base_url, api_key_env, ...), passed to "
    "serve; checked now, and it must be readable by the service user.",
)
@click.option(
    "--http",
    "http_listen",
    metavar="ADDR",
    default=None,
    help="Also serve Hermes's HTTP API (OpenAI chat completions, Responses, runs) on ADDR "
    "(PORT or HOST:PORT); needs the http extra.",
)
@click.option(
    "--env-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Secrets the supervisor reads, as NAME=value lines (the model key that the agent "
    "config's api_key_env names): the unit's EnvironmentFile=, read by systemd as root.",
)
@click.option(
    "--http-key",
    "http_key",
    metavar="NAME",
    default=None,
    help="With --http: make the HTTP key NAME in the service's data directory, owned by the "
    "service user, and write the key itself to /etc/hermes-sup/http-key-NAME (0600).",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    help="Write every file under this directory instead of / (an image being built, a test).",
)
def install_service(
    output: Path,
    user: str,
    config_file: Path,
    agent: str | None,
    agent_config: Path | None,
    http_listen: str | None,
    env_file: Path | None,
    http_key: str | None,
    root: Path,
) -> None:
    """Write a systemd unit (Type=notify, reloadable, hardened) for this install.

    It runs `hermes-sup serve` as a dedicated user, with sockets in
    /run/hermes-sup and sessions in /var/lib/hermes-sup (both 0700),
    KillMode=control-group so no worker outlives the service, and the
    settings in --config, which `systemctl reload hermes-sup` re-reads.
    It warns about any path of this install the service could not reach.

    Hermes behind HTTP: --agent hermes --agent-config FILE --http ADDR, the
    model key in --env-file (root's, 0600; the agent config names it with
    api_key_env), and --http-key NAME for the first front end's key.

    \b
    Example:
      sudo hermes-sup install-service
      sudo useradd --system --no-create-home hermes-sup
      sudo systemctl daemon-reload && sudo systemctl enable --now hermes-sup
      hermes-sup install-service --output - | less    # only look at it
      sudo hermes-sup install-service --agent hermes --agent-config /etc/hermes-sup/agent.toml \\
          --env-file /etc/hermes-sup/secrets.env --http 127.0.0.1:8642 --http-key webui
    """
    settings = service_settings(agent, agent_config, http_listen, env_file, http_key)
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
        env_file=env_file.absolute() if env_file is not None else None,
        delegate_subgroup=version is None or version >= DELEGATE_SUBGROUP_SINCE,
    )
    warn_unreachable(paths, agent_config, user, protect_home)
    if str(output) == "-":
        click.echo(text, nl=False)
        if settings:
            click.echo(f"# and in {config_file}:\n" + "\n".join(settings), err=True)
        return
    # The settings file goes with a unit installed in the system, or when named.
    ctx = click.get_current_context()
    installing = output == DEFAULT_UNIT or (
        ctx.get_parameter_source("config_file") is not click.core.ParameterSource.DEFAULT
    )
    output, config_file = under(root, output), under(root, config_file)
    if settings and config_file.exists():
        # Never an edit of the operator's own file behind their back.
        raise click.ClickException(
            f"{config_file} exists: add these lines to it (or move it away and run this again):\n"
            + "\n".join(settings)
        )
    try:
        if root != Path("/"):
            output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from None
    wrote = [f"wrote {output}"]
    if (installing or settings) and not config_file.exists():
        wrote.append(write_config(config_file, settings))
    if http_key is not None:
        wrote.append(make_http_key(root, http_key, user))
    click.echo(
        "\n".join(wrote) + "\nnext:\n"
        f"  useradd --system --no-create-home --shell /usr/sbin/nologin {user}\n"
        "  systemctl daemon-reload\n  systemctl enable --now hermes-sup\n"
        "  HERMES_SUP_STATE_DIR=/run/hermes-sup hermes-sup status"
    )
