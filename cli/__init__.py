"""hermes-sup cli."""
