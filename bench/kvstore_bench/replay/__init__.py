"""`kvstore bench replay`: agent or Mooncake traces replayed against each store (no engines)."""
