"""`python -m hermes_sup.cli`: the `hermes-sup` command."""

from hermes_sup.cli.main import main

main()
