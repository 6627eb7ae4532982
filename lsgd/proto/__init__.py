"""Generated gRPC code for ``protos/lsgd.proto`` (regenerate with ``python -m lsgd.proto.generate``)."""
