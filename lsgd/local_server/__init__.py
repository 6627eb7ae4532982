"""The per-node local server: shared memory, worker processes, relay to the global server."""
