"""crossoverd, the per-node daemon: the scheduler core, its policies (`policies/`), its sockets and services."""
