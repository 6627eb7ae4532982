"""The global server: authority for the counter, membership, leaders, center and stop rule."""
