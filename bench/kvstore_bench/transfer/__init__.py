"""`kvstore bench transfer` and `kvstore bench store`: bytes and operations against the ceilings."""
