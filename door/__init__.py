"""How a hermes-sup service listens for front ends: the one front door that
the supervisor and the router (`hermes-sup route`) both build on.

Server side only, and nothing of sessions, workers or nodes: binding the
local control socket and the CURVE TCP socket (`fronts`), client ids,
connection caps (`gate`), slow consumers with their `dropped` notices and
owed answers, driving a socket from the asyncio loop in bounded batches
(`channel`), CURVE keys and the allowlist (`remote`), the private state
directory, its key and lock (`privatedir`), and log lines a peer can cause
at will, throttled (`throttle`). It imports `protocol` and `local`, never
`supervisor` or `cluster` (tests/test_layout.py holds that).
"""
