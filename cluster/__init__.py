"""hermes-sup beyond one machine: a router in front of many supervisors, and
Ray node agents that run one supervisor per node.

Pure placement logic (rendezvous hashing, the override table, merging
answers of many nodes) lives in modules that do no I/O (`placement`,
`merge`, `nodes`); the router process is `router`; everything that imports
Ray is in `ray_agents` and is only loaded by `hermes-sup ray ...` and
`route --ray`.
"""
