"""A worker allocates from one malloc arena, the zygote's main one
(worker/zygote.py, `one_malloc_arena`): glibc would otherwise give each of
its threads (the turn's, zmq's) an arena of its own, pages that no other
process shares."""

from __future__ import annotations

from typing import Any

# glibc reserves each thread's arena as 64 MiB aligned to 64 MiB: the part
# in use readable and writable, the rest inaccessible.
ARENA_RESERVED = 64 * 2**20


def thread_arenas(pid: int) -> list[str]:
    """The start addresses of the glibc thread arenas in a process's maps."""
    rows = []
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            rows.append((start, end, fields[1], fields[5] if len(fields) > 5 else ""))
    found = []
    for i, (start, end, perms, path) in enumerate(rows):
        if path or start % ARENA_RESERVED or perms != "rw-p":
            continue
        size = end - start
        if i + 1 < len(rows) and rows[i + 1][0] == end and rows[i + 1][2] == "---p":
            size += rows[i + 1][1] - rows[i + 1][0]
        if size == ARENA_RESERVED:
            found.append(hex(start))
    return found


def test_a_workers_threads_share_the_main_malloc_arena(supervisor: Any) -> None:
    with supervisor.client() as client:
        pid = int(client.run("arenas", "pid").text)
        for _ in range(3):  # the turn thread and zmq's allocate on each turn
            assert client.run("arenas", "echo " + "x" * 100_000).ok
        worker = [r["pid"] for r in client.sessions() if r["key"] == "arenas"][0]
    assert thread_arenas(worker) == [], (pid, worker)
