"""Running the endpoint: uvicorn in a process of its own.

Two ways, one code path (`run`):

- `hermes-sup serve --http [HOST:]PORT`: `start_beside_supervisor` runs in
  the serve command before the supervisor starts. It binds the listening
  socket (so a taken port or a missing key fails `serve` at once, with a
  clear message), then starts `python -m hermes_sup.httpapi` through a
  double fork: the endpoint is not the supervisor's child, so the
  supervisor's reaper and its orphan cull (which kills any child that is
  not a worker) never see it, and the supervisor gets no thread, no event
  loop and no socket of it. It inherits the listening socket and the read
  end of a pipe whose write end only the supervisor process holds
  (close-on-exec, so no worker or zygote inherits it): when the supervisor
  exits, however it exits, the pipe reads EOF and the endpoint stops. It
  connects as a local client of the state directory, like any front end,
  and answers 503 until the supervisor is ready. Its log lines go to the
  supervisor's stderr. What is started is the keeper (keeper.py), which
  runs the endpoint as its child and starts a new one (backing off) if it
  dies; the keeper holds the socket and watches the same pipe.
- `hermes-sup http --connection FILE [--listen HOST:PORT]`: the same
  endpoint as a process of its own, on another host, a remote client over
  CURVE (a connection file from `hermes-sup keys generate`). It runs until
  stopped (SIGTERM / Ctrl-C); while its supervisor is unreachable it
  answers 503.

Either way the bearer keys are read from a data directory's
`http/keys/` (`hermes-sup keys http generate NAME`), and with none there
the endpoint does not start. Its settings (settings.py) reach it as flags
(the `[http_api]` table of serve's configuration file, or `hermes-sup
http`'s own flags); one not given is read from its environment variable
here, in the endpoint's own process, which `serve --http` starts with
serve's environment, then is its default. The browser origins fall back
on Hermes's own variable too (origins.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hermes_sup.client import AsyncClient
from hermes_sup.local import addresses
from hermes_sup.local.settings import SettingError, from_text

from .app import create_app
from .guard import connection_cap, guarded_protocol
from .keys import KeyStore
from .logsafe import kv
from .origins import origins_from_env, parse_origins
from .settings import API_SETTINGS, RETRY_GRACE_ENV, ApiSettings
from .shares import ShareLimits, Shares

__all__ = [
    "RETRY_GRACE_ENV",
    "HttpSetupError",
    "main",
    "parse_listen",
    "require_keys",
    "run",
    "start_beside_supervisor",
]

log = logging.getLogger("hermes_sup.httpapi")

DEFAULT_PORT = 8642  # Hermes's API server's port: front ends default to it
KEEP_ALIVE = 5  # seconds a keep-alive connection may stay silent after an answer


class HttpSetupError(Exception):
    """The endpoint cannot start; the message says why and what to do."""


def parse_listen(spec: str) -> tuple[str, int]:
    """'PORT' (loopback) or 'HOST:PORT' (see local/addresses.py); port 0
    lets the kernel choose."""
    try:
        return addresses.parse_listen(spec, "http", any_port=True)
    except ValueError as exc:
        raise HttpSetupError(str(exc)) from None


def require_keys(data_dir: Path) -> KeyStore:
    """The key store; refuses when it holds no key (no key, no service)."""
    keys = KeyStore(data_dir)
    if not keys.names():
        raise HttpSetupError(
            f"no HTTP API key is configured in {keys.dir}: make one with "
            f"`hermes-sup keys http generate NAME --data-dir {data_dir}` "
            "(the endpoint never serves without a key)"
        )
    return keys


def check_web_dir(path: Path) -> Path:
    """A directory of static files to serve at /, with its index.html."""
    if not (path / "index.html").is_file():
        raise HttpSetupError(
            f"--web {path}: not a directory with an index.html (the page to serve at /)"
        )
    return path.resolve()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a taken port fails with its reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto
    # says TCP, and accepted sockets inherit it. Without it, Nagle's algorithm
    # and delayed ACKs held every response back 40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise HttpSetupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(
    sock: socket.socket,
    keys: KeyStore,
    connect: Callable[[], AsyncClient],
    settings: ApiSettings | None = None,
    watch_fd: int | None = None,
    log_level: str = "info",
) -> None:
    """Serve on `sock` until SIGTERM/SIGINT, or until `watch_fd` reads EOF."""
    import uvicorn

    app = create_app(settings or ApiSettings(), keys, connect)
    config = uvicorn_config(app, app.state.api.settings, log_level)
    server = uvicorn.Server(config)

    async def main() -> None:
        if watch_fd is not None:
            loop = asyncio.get_running_loop()

            def parent_gone() -> None:
                loop.remove_reader(watch_fd)
                log.info(kv("http_stopping", reason="the supervisor exited"))
                server.should_exit = True

            loop.add_reader(watch_fd, parent_gone)
        settings = app.state.api.settings
        log.info(
            kv(
                "http_ready",
                url=url_of(sock),
                pid=os.getpid(),
                model=settings.model,
                cors_origins=",".join(settings.cors_origins) or "none",
            )
        )
        await server.serve(sockets=[sock])

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())


def uvicorn_config(app: Any, settings: ApiSettings, log_level: str = "info") -> Any:
    """How the endpoint is served (and the bench's floors, so that only
    the app differs): uvicorn with guard.py's protocol, keep-alive
    connections closed after 5 s of silence."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=guarded_protocol(
            settings.header_timeout, settings.max_connections, shares_of(app, settings)
        ),
        timeout_keep_alive=KEEP_ALIVE,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        log_config=None,  # our logging setup, on stderr like the supervisor's
    )


def shares_of(app: Any, settings: ApiSettings) -> Shares:
    """Each key's share of the endpoint (shares.py), its refusals logged
    with the key's name when `app` is the endpoint's."""
    api = getattr(getattr(app, "state", None), "api", None)
    keys = getattr(api, "keys", None)

    def name_of(token: str) -> str | None:
        tenant = keys.check(token) if keys is not None else None
        return tenant.name if tenant is not None else None

    limits = ShareLimits(settings.key_requests, settings.key_connections)
    return Shares(limits, connection_cap(settings.max_connections), name_of)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (the `http` extra does not
    require it), else None: asyncio's. We call the runner ourselves, so
    uvicorn's `loop="auto"` would never install it. On uvloop the endpoint
    spends 5 - 9% less CPU a request (BENCHMARKS.md, "HTTP endpoint")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def start_beside_supervisor(
    state_dir: Path,
    data_dir: Path,
    listen: str,
    log_level: str = "info",
    web_dir: Path | None = None,
    settings_argv: Sequence[str] = (),
) -> str:
    """Start the endpoint for the supervisor about to run in this process
    (see the module docstring), with its settings as flags (`to_argv`).
    Call before the supervisor starts: it forks, so this process must have
    no threads and no zmq context yet. Returns the URL it listens on."""
    host, port = parse_listen(listen)
    require_keys(data_dir)
    web = [] if web_dir is None else ["--web", str(check_web_dir(web_dir))]
    sock = bind(host, port)
    url = url_of(sock)
    watch_r, watch_w = os.pipe()  # both close-on-exec: no worker inherits them
    argv = [
        sys.executable,
        "-m",
        "hermes_sup.httpapi",
        "--keep",
        "--state-dir",
        str(state_dir),
        "--data-dir",
        str(data_dir),
        "--fd",
        str(sock.fileno()),
        "--watch-fd",
        str(watch_r),
        "--log-level",
        log_level,
        *web,
        *settings_argv,
    ]
    middle = os.fork()
    if middle == 0:  # the intermediate: spawn the endpoint, then leave it to init
        code = 1
        try:
            os.close(watch_w)
            sock.set_inheritable(True)
            os.set_inheritable(watch_r, True)
            os.posix_spawn(sys.executable, argv, dict(os.environ), setsid=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(middle, 0)
    os.close(watch_r)
    sock.close()
    if os.waitstatus_to_exitcode(status) != 0:
        os.close(watch_w)
        raise HttpSetupError("could not start the HTTP endpoint's process")
    # watch_w stays open, unused, for as long as this process lives.
    return url


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The endpoint process's arguments: where it runs, then one flag per
    setting of the endpoint (settings.py), each read as text (`from_text`)."""
    parser = argparse.ArgumentParser(prog="python -m hermes_sup.httpapi")
    parser.add_argument("--state-dir", type=Path, help="the local supervisor's state directory")
    parser.add_argument("--connection", type=Path, help="a remote supervisor's connection file")
    parser.add_argument("--data-dir", type=Path, required=True, help="where http/keys/ is")
    parser.add_argument("--fd", type=int, help="an inherited listening socket")
    parser.add_argument("--listen", default=str(DEFAULT_PORT), help="[HOST:]PORT without --fd")
    parser.add_argument("--watch-fd", type=int, help="stop when this pipe reads EOF")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--web", type=Path, help="a directory of static files to serve at /")
    parser.add_argument(
        "--keep", action="store_true", help="run the endpoint as a child, restarted if it dies"
    )
    for s in API_SETTINGS.values():
        parser.add_argument(
            s.flag,
            dest=s.name,
            action="append" if s.repeatable else "store",
            metavar=s.metavar or s.base.__name__.upper(),
            help=s.option_help().replace("%", "%%"),  # argparse formats help with %
        )
    args = parser.parse_args(argv)
    if args.keep and (args.fd is None or args.watch_fd is None):
        parser.error("--keep needs --fd and --watch-fd")
    return args


def api_settings(
    args: argparse.Namespace, environ: Mapping[str, str], web_dir: Path | None
) -> ApiSettings:
    """The endpoint's settings: each its flag if given, else its environment
    variable if set, else its default. HttpSetupError naming a bad one."""
    values: dict[str, Any] = {}
    for name, s in API_SETTINGS.items():
        given = getattr(args, name)
        if name == "cors_origins":
            # Comma-separated or repeated; else ours, else Hermes's variable.
            values[name] = parse_origins(given) if given else origins_from_env(environ)
            continue
        if given is not None:
            where, text = s.flag, given
        elif s.envvar and environ.get(s.envvar, "").strip():
            where, text = f"{s.envvar}={environ[s.envvar]!r}", environ[s.envvar]
        else:
            continue
        try:
            values[name] = from_text(s, text)
        except SettingError as exc:
            raise HttpSetupError(f"{where}: {exc}") from None
    return ApiSettings(**values, web_dir=web_dir)


def connector(args: argparse.Namespace) -> Callable[[], AsyncClient]:
    """How the endpoint reaches its supervisor: a connection file's remote
    one, else the local one of the state directory."""
    if args.connection is not None:
        path = args.connection
        return lambda: AsyncClient.from_connection_file(path)
    state_dir = args.state_dir
    return lambda: AsyncClient(state_dir)


def main(argv: list[str] | None = None) -> None:
    """`python -m hermes_sup.httpapi`: the process `serve --http` starts."""
    given = sys.argv[1:] if argv is None else argv
    args = parse_args(given)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # As root, the OOM killer's last choice with the supervisor (a session's
    # worker goes first); the keeper's endpoint inherits it.
    from hermes_sup.local.cgroupfs import lower_oom_score

    lower_oom_score()
    if args.keep:
        from .keeper import keep

        endpoint = [sys.executable, "-m", "hermes_sup.httpapi"]
        keep(
            [*endpoint, *(a for a in given if a != "--keep")],
            args.watch_fd,
            (args.fd, args.watch_fd),
        )
        return
    try:
        keys = require_keys(args.data_dir)
        web_dir = None if args.web is None else check_web_dir(args.web)
        settings = api_settings(args, os.environ, web_dir)
        if args.fd is not None:
            sock = socket.socket(fileno=args.fd)
        else:
            sock = bind(*parse_listen(args.listen))
    except HttpSetupError as exc:
        log.error(kv("http_failed", error=exc))
        sys.exit(1)
    run(sock, keys, connector(args), settings, args.watch_fd, args.log_level)
