"""The disco.v1 wire contract, its conversions, and the gRPC runtime in its own package.

* ``protos/disco/v1/*.proto`` — the contract (``package disco.v1``); the generated
  ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*.pyi`` next to them are committed and import as
  ``protos.disco.v1.draft_pb2`` (no build hook; regenerate with ``python -m protos.generate``,
  a test checks they never drift).
* :mod:`protos.convert` — message <-> core dataclass / tensor conversions.
* :mod:`protos.stats` — request statistics <-> messages (torch-free, for the client).
* :mod:`protos.runtime` — the gRPC runtime: server builder (health + reflection), the
  error interceptor, TLS, Prometheus metrics, structured logs.

Nothing in :mod:`disco` imports this package: the core stays free of grpc.
"""
