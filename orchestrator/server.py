"""Start the public orchestrator (``disco orchestrator`` and Ray actors call this).

The orchestrator holds no model: only the target's tokenizer, and channels to the
draft and target services.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from disco.errors import DiscoError, ModelError
from disco.models.default_pair import ensure_default_model
from disco.models.gguf import convert_gguf
from disco.models.loading import tokenizer_hash
from orchestrator.backend_health import WATCH_INTERVAL_S, BackendWatch
from orchestrator.backends import Backends
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.routing import ReplicaSet
from orchestrator.servicer import SERVICE_NAME, OrchestratorLimits, OrchestratorServicer
from protos.disco.v1 import orchestrator_pb2_grpc
from protos.runtime.server import RunningServer, start_server
from protos.runtime.auth import BearerTokenInterceptor, TokenCallInterceptor
from protos.runtime.tls import TlsFiles

#: Largest public request accepted (gRPC's default is 4 MiB; a backend's is far larger
#: since draft distributions travel between services).
PUBLIC_MAX_RECEIVE_BYTES = 8 * 1024 * 1024


def load_tokenizer(spec: str | None, home: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the target model ``spec`` (an HF folder, a ``.gguf`` file, a hub
    id, or ``None`` for the default pair), without loading any weights.

    Raises:
        ModelError: the tokenizer cannot be found or read.
    """
    if spec is None:
        location = str(ensure_default_model("target", home))
    elif Path(spec).expanduser().is_file() and spec.endswith(".gguf"):
        location = str(convert_gguf(Path(spec).expanduser(), home))
    else:
        location = str(Path(spec).expanduser()) if Path(spec).expanduser().is_dir() else spec
    try:
        return AutoTokenizer.from_pretrained(location)
    except Exception as error:  # noqa: BLE001 -- NOTE: loaders raise anything (hub, json)
        reason = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise ModelError(f"could not load the tokenizer of {spec or 'the default target'} "
                         f"from {location}: {reason}") from error


def serve(tokenizer: PreTrainedTokenizerBase, draft_address: str | ReplicaSet, target_address: str | ReplicaSet, *,
          host: str = "127.0.0.1", port: int = 0, limits: OrchestratorLimits = OrchestratorLimits(),
          tls: TlsFiles | None = None, require_client_cert: bool = False,
          auth_tokens: str | Sequence[str] | None = None, backend_token: str | None = None,
          metrics_port: int | None = None, watch_interval_s: float = WATCH_INTERVAL_S,
          backend_interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> RunningServer:
    """Start the public ``disco.v1.Orchestrator`` service; returns at once.

    The backends need not be up yet: each request reaches them when it runs (and gets
    ``UNAVAILABLE`` if it cannot).

    Args:
        tokenizer: the target model's tokenizer.
        draft_address: ``HOST:PORT`` of the draft service (comma-separated for several
            replicas), or a :class:`~orchestrator.routing.ReplicaSet` (e.g. discovered through Ray).
        target_address: the same for the target service.
        host: interface to bind.
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: request limits.
        tls: ``cert``/``key``: serve the public API over TLS and present them to the
            backends (mTLS client identity); ``ca``: verify the backends with it.
        require_client_cert: also require public clients to present a certificate signed by ``tls.ca``.
        auth_tokens: require ``authorization: Bearer <token>``, one of these (the public API's
            keys), on the public API (health exempt); ``None`` or empty: no token.
        backend_token: present ``authorization: Bearer <backend_token>`` on every call to the
            backends (their credential, never a public token; :mod:`protos.runtime.auth`).
        metrics_port: serve Prometheus ``/metrics`` on ``host:metrics_port`` (0: a free port).
        watch_interval_s: seconds between two rounds of the backends' health checks
            (:class:`~orchestrator.backend_health.BackendWatch`).
        backend_interceptors: client interceptors on every call to a backend (none by default).

    Raises:
        DiscoError: the address cannot be bound.
    """
    tokens = (auth_tokens,) if isinstance(auth_tokens, str) else tuple(auth_tokens or ())
    if backend_token and backend_token in tokens:
        raise DiscoError("the backend token must differ from the public API's tokens (a public client would "
                         "otherwise reach the backends)")
    credential = (TokenCallInterceptor(backend_token),) if backend_token else ()
    backends = Backends(draft_address, target_address, tokenizer_hash(tokenizer), tls=tls,
                        interceptors=(*backend_interceptors, *credential))
    metrics = OrchestratorMetrics(tokenizer.name_or_path)
    servicer = OrchestratorServicer(tokenizer, backends, limits, metrics)
    serving_tls = tls if tls is not None and tls.cert is not None else None
    # Each streaming request holds a thread for its duration; Info calls get spare ones.
    running = start_server([(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer, SERVICE_NAME)],
                           host, port, max_workers=limits.max_sessions + 8, tls=serving_tls,
                           require_client_cert=require_client_cert, metrics=metrics, metrics_port=metrics_port,
                           interceptors=[BearerTokenInterceptor(tokens)] if tokens else [],
                           max_receive_bytes=PUBLIC_MAX_RECEIVE_BYTES)
    # The draft's and the target's health, per role, in this server's health service and /metrics.
    watch = BackendWatch({"draft": backends.draft, "target": backends.target}, running.health, metrics.registry)
    running.servicers = (*running.servicers, watch.start(watch_interval_s))
    return running
