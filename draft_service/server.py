"""Start a draft service around a loaded model (``disco draft-server`` and Ray actors call this)."""

from __future__ import annotations

from disco.draft_engine import DraftEngine
from disco.models import LoadedModel
from disco.pipeline import default_learned_loader
from disco.policies import PolicyFactory
from disco.sessions import SessionLimits
from draft_service.servicer import SERVICE_NAME, DraftServicer
from protos.disco.v1 import draft_pb2_grpc
from protos.runtime import RunningServer, start_server


def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 0, limits: SessionLimits = SessionLimits(),
          policy_factory: PolicyFactory | None = None) -> RunningServer:
    """Start serving ``loaded`` as the draft model; returns at once (the server runs in threads).

    Args:
        loaded: the draft model.
        host: interface to bind (127.0.0.1 unless the deployment says otherwise).
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: session limits of the engine.
        policy_factory: builds per-session stop policies; the default resolves ``disco:`` specs
            as the in-process pipeline does.

    Raises:
        DiscoError: the address cannot be bound.
    """
    engine = DraftEngine(loaded.model, policy_factory or PolicyFactory(default_learned_loader()), limits)
    servicer = DraftServicer(engine, loaded, limits)
    # One thread per in-flight call: every session may be drafting at once, plus Info calls.
    return start_server([(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer, SERVICE_NAME)],
                        host, port, max_workers=limits.max_sessions + 8)
