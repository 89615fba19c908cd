"""`kvstore bench scale`: the control plane with many simulated workers."""
