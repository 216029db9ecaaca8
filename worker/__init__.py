"""hermes-sup worker."""
