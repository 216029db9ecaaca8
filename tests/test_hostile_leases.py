"""A hostile session against its own lease: the `lease` and `epoch` files
are in the session's directory, which its shell sees read-only. Were they
writable, a session could rename its lease away or bump its epoch, and its
supervisor, reading every lease back twice a second, would give the
session up to whichever node asked next. Real supervisors, real shells."""

from __future__ import annotations

import os

import pytest

from hermes_sup.protocol import session_dir_name
from hermes_sup.supervisor import leases

from .test_hostile_session import Lab, lab, refused, tries  # noqa: F401 - `lab` is a fixture

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts supervisors as root and as nobody"),
]


def test_a_session_can_neither_move_nor_fence_off_its_own_lease(lab: Lab) -> None:  # noqa: F811
    own = lab.data_dir / "sessions" / session_dir_name("fencer")
    with lab.client() as client:
        pid = int(client.run("fencer", "pid").text)
        before = leases.read_epoch(own)
        got = tries(
            client,
            "fencer",
            {
                "write epoch": f"printf '99 forged' > {own}/epoch",
                "rename lease": f"mv {own}/lease {own}/lease.gone",
                "replace epoch": f"cp /dev/null {own}/e && mv -f {own}/e {own}/epoch",
                "remove lease": f"rm -f {own}/lease",
            },
        )
        for name, attempt in got.items():
            assert refused(attempt), (name, attempt)
        assert leases.read_epoch(own) == before
        assert (own / leases.LEASE_FILE).exists()
        # Still its own (a turn's start is fenced too), on the same worker.
        assert int(client.run("fencer", "pid").text) == pid
