"""Start a draft service around a loaded model (``disco draft-server`` and Ray actors call this)."""

from __future__ import annotations

import os
from typing import Sequence

from disco.engines.draft import DraftEngine
from disco.engines.in_process import default_learned_loader, grammar_compiler
from disco.engines.sessions import SessionLimits
from disco.models.loading import LoadedModel
from disco.speculation.policies import PolicyFactory
from draft_service.artifacts import restricted_loader
from draft_service.servicer import SERVICE_NAME, DraftServicer
from protos.disco.v1 import draft_pb2_grpc
from protos.runtime.metrics import ServerMetrics
from protos.runtime.server import RunningServer, start_server
from protos.runtime.backend_security import BackendSecurity
from protos.runtime.tls import TlsFiles


def serve(loaded: LoadedModel, *, host: str = "127.0.0.1", port: int = 0, limits: SessionLimits = SessionLimits(),
          policy_factory: PolicyFactory | None = None, artifact_dirs: Sequence[str | os.PathLike] = (),
          max_prompt_tokens: int | None = None, tls: TlsFiles | None = None,
          metrics_port: int | None = None, forward_s: Sequence[float] = (), prefill_s_per_token: float = 0.0,
          security: BackendSecurity = BackendSecurity(), overlap: bool = False,
          prefill_window: int = 0) -> RunningServer:
    """Start serving ``loaded`` as the draft model; returns at once (the server runs in threads).

    Args:
        loaded: the draft model.
        host: interface to bind (127.0.0.1 unless the deployment says otherwise).
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: session limits of the engine.
        policy_factory: builds per-session stop policies; the default resolves ``disco:`` specs
            as the in-process pipeline does (refusing artifacts trained for another draft),
            limited to ``disco:default`` and the artifacts in ``artifact_dirs``.
        artifact_dirs: folders whose DISCO artifacts requests may name (see
            :mod:`draft_service.artifacts`: a request must not make the service open any file).
        max_prompt_tokens: longest ``StartSession`` prompt (re-prefills included); ``None``: the
            model's context is the only limit.
        tls: serve TLS; with ``tls.ca`` clients must present a certificate it signed (mTLS).
        metrics_port: serve Prometheus ``/metrics`` on ``host:metrics_port`` (0: a free port).
        forward_s: the model's measured forward costs (:mod:`disco.engines.engine_costs`), reported by ``Info``;
            ``prefill_s_per_token`` its measured prefill per prompt token.
        security: the credentials callers must present (:class:`BackendSecurity`: the backend token,
            ``--insecure``); checked against ``host`` and ``tls`` before anything is bound.
        overlap: overlapped drafting (:mod:`disco.engines.predraft`): pre-draft each session's next block
            while the target verifies the last one; reported by ``Info``, counted in ``/metrics``.
        prefill_window: a session's draft reads at most this many prompt tokens (0: all;
            :class:`~disco.engines.draft.DraftEngine`); reported by ``Info``.

    Raises:
        DiscoError: the address cannot be bound, or it would be reachable without credentials
            (:meth:`BackendSecurity.statement`).
    """
    policy_factory = policy_factory or PolicyFactory(restricted_loader(default_learned_loader(loaded), artifact_dirs))
    statement = security.statement(host, tls)  # refuses an exposed backend before any work
    security.warn(statement)
    engine = DraftEngine(loaded.model, policy_factory, limits, overlap=overlap, grammar=grammar_compiler(loaded),
                         prefill_window=prefill_window)
    metrics = ServerMetrics("draft", loaded.name)
    metrics.track_batches(lambda: engine.batcher.batch_sizes, engine.batcher.packed,
                          engine.batcher.describe())
    metrics.track_live_costs(engine.batcher.live_costs.seconds_by_rows)
    metrics.describe_security(statement)
    servicer = DraftServicer(engine, loaded, limits, max_prompt_tokens, metrics, forward_s, statement, prefill_s_per_token)
    # One thread per in-flight call: every session may be drafting at once, plus Info calls.
    return start_server([(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer, SERVICE_NAME)],
                        host, port, max_workers=limits.max_sessions + 8, tls=tls, metrics=metrics,
                        metrics_port=metrics_port, interceptors=security.interceptors())
