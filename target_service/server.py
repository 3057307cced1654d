"""Start a target service around a loaded model (``disco target-server`` and Ray actors call this)."""

from __future__ import annotations

from typing import Sequence

from disco.engines.sessions import SessionLimits
from disco.engines.in_process import grammar_compiler
from disco.engines.target import TargetEngine
from disco.models.loading import LoadedModel
from protos.disco.v1 import target_pb2_grpc
from protos.runtime.metrics import ServerMetrics
from protos.runtime.server import RunningServer, start_server
from protos.runtime.backend_security import BackendSecurity
from protos.runtime.tls import TlsFiles
from target_service.servicer import SERVICE_NAME, TargetServicer


def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 0, limits: SessionLimits = SessionLimits(),
          max_prompt_tokens: int | None = None, tls: TlsFiles | None = None,
          metrics_port: int | None = None, forward_s: Sequence[float] = (), prefill_s_per_token: float = 0.0,
          security: BackendSecurity = BackendSecurity()) -> RunningServer:
    """Start serving ``loaded`` as the target model; returns at once (the server runs in threads).

    Args:
        loaded: the target model.
        host: interface to bind (127.0.0.1 unless the deployment says otherwise).
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: session limits of the engine.
        max_prompt_tokens: longest ``StartSession`` prompt (re-prefills included); ``None``: the
            model's context is the only limit.
        tls: serve TLS; with ``tls.ca`` clients must present a certificate it signed (mTLS).
        metrics_port: serve Prometheus ``/metrics`` on ``host:metrics_port`` (0: a free port).
        forward_s: the model's measured forward costs (:mod:`disco.engines.engine_costs`), reported by ``Info``;
            ``prefill_s_per_token`` its measured prefill per prompt token.
        security: the credentials callers must present (:class:`BackendSecurity`: the backend token,
            ``--insecure``); checked against ``host`` and ``tls`` before anything is bound.

    Raises:
        DiscoError: the address cannot be bound, or it would be reachable without credentials
            (:meth:`BackendSecurity.statement`).
    """
    statement = security.statement(host, tls)  # refuses an exposed backend before any work
    security.warn(statement)
    engine = TargetEngine(loaded.model, limits, grammar=grammar_compiler(loaded))
    metrics = ServerMetrics("target", loaded.name)
    metrics.track_batches(lambda: engine.batcher.batch_sizes, engine.batcher.packed,
                          engine.batcher.describe())
    metrics.track_live_costs(engine.batcher.live_costs.seconds_by_rows)
    metrics.describe_security(statement)
    servicer = TargetServicer(engine, loaded, limits, max_prompt_tokens, metrics, forward_s, statement, prefill_s_per_token)
    return start_server([(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
                        host, port, max_workers=limits.max_sessions + 8, tls=tls, metrics=metrics,
                        metrics_port=metrics_port, interceptors=security.interceptors())
