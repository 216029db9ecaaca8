"""A data directory's identity, made by whichever node starts first: every
node that starts beside it reads the same, whole (never the empty file the
first one had made but not yet written)."""

from __future__ import annotations

import os
from pathlib import Path

from hermes_sup.cluster.nodes import DATA_ID_FILE, data_id


def test_nodes_starting_at_once_read_one_whole_identity(tmp_path: Path) -> None:
    for round_ in range(20):
        data = tmp_path / f"data{round_}"
        r, w = os.pipe()
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                try:
                    os.write(w, (data_id(data) + "\n").encode())
                finally:
                    os._exit(0)
            pids.append(pid)
        os.close(w)
        for pid in pids:
            os.waitpid(pid, 0)
        with os.fdopen(r) as got:
            seen = got.read().split("\n")[:-1]
        assert len(seen) == 6 and len(set(seen)) == 1 and len(seen[0]) == 32, seen
        # And nothing of the making is left beside it.
        assert [p.name for p in data.iterdir()] == [DATA_ID_FILE]
