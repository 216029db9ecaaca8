"""hermes-sup's benchmarks: each figure measured beside a floor in the same run.

Entry points, run from the repository root as `python -m bench.NAME`
(BENCHMARKS.md says what each measures and what it found):

- run: spawn, round trip, idle memory, scale and Hermes ready (`make bench`);
  its pieces are in spawn.py and round_trip.py
- ab: two installs side by side, for judging a change
- fanin: many sessions streaming at once through one supervisor
- http_bench: the HTTP endpoint (stack, latency, streams and profile in
  http_*.py; the floor apps in http_floor.py)
- route: routed turns, a cluster's scale and a node's failover
- sealed, sealed_probe: sealed sessions, Hermes and probe
- soak: mixed load and faults for minutes (`make soak`; soak_*.py)
- startup: how long a `hermes-sup` command takes to start, beside its floors

common.py holds what they share: percentiles, the measured supervisor,
CPU and memory readings. Results go to bench/results/ (not committed).
"""
