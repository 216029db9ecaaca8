"""hermes-sup supervisor."""
