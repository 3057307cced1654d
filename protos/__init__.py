"""The disco.v1 wire contract and the small gRPC runtime shared by the three services.

* ``protos/disco/v1/*.proto`` — the contract (``package disco.v1``); the generated
  ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*.pyi`` next to them are committed and import as
  ``protos.disco.v1.draft_pb2`` (no build hook; regenerate with ``python -m protos.generate``,
  a test checks they never drift).
* :mod:`protos.convert` — message <-> core dataclass / tensor conversions.
* :mod:`protos.runtime` — the error interceptor, server builder (health + reflection)
  and graceful shutdown.

Nothing in :mod:`disco` imports this package: the core stays free of grpc.
"""
