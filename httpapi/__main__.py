"""`python -m hermes_sup.httpapi`: the endpoint's process (see serve.py)."""

from .serve import main

main()
