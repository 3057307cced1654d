"""Start a target service around a loaded model (``disco target-server`` and Ray actors call this)."""

from __future__ import annotations

from disco.models import LoadedModel
from disco.sessions import SessionLimits
from disco.target_engine import TargetEngine
from protos.disco.v1 import target_pb2_grpc
from protos.runtime import RunningServer, start_server
from target_service.servicer import SERVICE_NAME, TargetServicer


def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 0,
          limits: SessionLimits = SessionLimits()) -> RunningServer:
    """Start serving ``loaded`` as the target model; returns at once (the server runs in threads).

    Args:
        loaded: the target model.
        host: interface to bind (127.0.0.1 unless the deployment says otherwise).
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: session limits of the engine.

    Raises:
        DiscoError: the address cannot be bound.
    """
    engine = TargetEngine(loaded.model, limits)
    servicer = TargetServicer(engine, loaded, limits)
    return start_server([(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
                        host, port, max_workers=limits.max_sessions + 8)
