"""A supervisor's record of one session."""

from __future__ import annotations


def test_a_session_names_its_worker_from_its_hello_until_the_zygote_has(tmp_path) -> None:
    """A worker's hello can be read before the zygote's answer that names its
    pid; the `running` event sent then must still carry the pid."""
    from types import SimpleNamespace

    from hermes_sup.supervisor.environment import parse_options
    from hermes_sup.supervisor.session import Session

    session = Session(key="k", dir=tmp_path, options=parse_options(None))
    assert session.pid is None
    session.hello_pid = 4242
    assert session.pid == 4242
    session.proc = SimpleNamespace(pid=4242, returncode=None)  # type: ignore[assignment]
    assert session.pid == 4242
    session.proc.returncode = 0
    assert session.pid is None  # exited: no pid, whatever its hello said
