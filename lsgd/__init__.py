"""lsgd: a hierarchical parameter server for Leader SGD (LSGD) and Elastic Averaging SGD (EASGD).

Workers train locally; per-node local servers relay their requests to one gRPC global server
that owns the iteration counter, the leaders, the EASGD center and the stop decision. Parameters
move through node shared memory. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"
