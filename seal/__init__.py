"""Sealing a process: what the supervisor and the worker both need of it.

The worker seals itself (its namespaces, its filters, its uid: `steps`,
through the system calls of `calls`) and finds its session at the fixed
paths (`paths`); the supervisor runs the same steps in a child of its own
at start-up to learn whether this machine can seal at all, and tells each
worker those paths. So this package stands on neither: it imports the
standard library and hermes_sup.local only. What only a worker does (the
mounts that make its session's view) is worker/seal.py.
"""
