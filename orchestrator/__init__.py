"""Orchestrator: gRPC clients of the draft and target services, the public Generate API,
the Python client library and the ``disco`` command line."""
