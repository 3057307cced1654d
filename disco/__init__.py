"""disco-serve shared core: config, model loading, verification math, stop policies,
the speculation loop and metrics types.

Nothing in this package imports grpc or ray (a test enforces it): the in-process path,
the gRPC services and the Ray launcher all build on it.
"""

__version__ = "0.1.0"
