"""The draft, target and orchestrator services as Ray actors.

Each actor starts its gRPC server in ``__init__`` (the server runs in its own threads)
and answers ``address()`` and ``describe()``. :mod:`deploy.ray_launcher` creates them as
named, detached actors with ``max_restarts``: when one dies, Ray starts a new instance
(same name, same placement-group bundle), which loads its model again and listens on a
new port; the orchestrator asks for the new address (:mod:`deploy.ray_resolver`) and
re-prefills the sessions it had there.

The classes are plain Python classes; the launcher wraps them with ``ray.remote``.

Credentials (the backend token, the public API's tokens) are constructor arguments: Ray
keeps them in the actor's creation task in the GCS (readable with the cluster's Ray token
only) and replays them when it restarts the actor, so a restarted replica accepts the same
backend token. Ray's state API and dashboard (``ray list actors --detail``, ``list_tasks``)
do not show constructor arguments, whereas they show a runtime environment's variables.
"""

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()  # this module is the first one a Ray worker imports: before torch

import os  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import grpc  # noqa: E402
import ray  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

HEALTH_TIMEOUT_S = 2.0
ANY_HOST = ("0.0.0.0", "::", "")


def _advertised(host: str, port: int) -> str:
    """The address others use: the node's IP when bound to every interface."""
    from protos.runtime.server import format_address  # noqa: PLC0415

    return format_address(ray.util.get_node_ip_address() if host in ANY_HOST else host, port)


def _resources() -> dict[str, float]:
    """Resources Ray assigned to this actor, without placement-group suffixes."""
    merged: dict[str, float] = {}
    for key, amount in ray.get_runtime_context().get_assigned_resources().items():
        name = key.split("_group_")[0]
        merged[name] = max(merged.get(name, 0.0), amount)
    return merged


def _tls(paths: dict | None):
    """:class:`protos.runtime.tls.TlsFiles` from ``{"cert", "key", "ca", "server_name"}`` paths on
    this node (``None``: plaintext)."""
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    return TlsFiles.from_paths(**paths) if paths else None


def _health(address: str, service: str, tls: Any = None) -> str:
    from protos.runtime.tls import secure_channel  # noqa: PLC0415

    channel = secure_channel(address, tls)  # with mTLS, this actor's own certificate is the client identity
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=HEALTH_TIMEOUT_S)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except grpc.RpcError as error:
        return f"UNREACHABLE ({error.code().name})"
    finally:
        channel.close()


def _describe(role: str, address: str, service: str, running: Any, tls: Any, **extra: Any) -> dict:
    context = ray.get_runtime_context()
    return {"name": context.get_actor_name(), "role": role, "address": address, "tls": tls is not None,
            "metrics": running.metrics_address,
            "node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "resources": _resources(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "restarted": context.was_current_actor_reconstructed, "health": _health(address, service, tls), **extra}


class ModelService:
    """A draft or target service (one model) inside a Ray actor.

    Args:
        role: ``"draft"`` or ``"target"``.
        model: :class:`disco.config.ModelConfig` fields (spec, dtype, device); dtype ``"auto"``
            is resolved here, on the node the replica runs on.
        host: interface to bind (``None``: this node's IP as Ray sees it).
        limits: :class:`disco.engines.sessions.SessionLimits` fields.
        tls: ``{"cert", "key", "ca"}`` PEM paths readable on this node: serve TLS; with
            ``ca``, require client certificates it signed (mTLS). ``None``: plaintext.
        metrics: serve Prometheus ``/metrics`` on a free port of ``host`` (see ``describe()``).
        overlap: draft only: overlapped drafting (pre-draft the next block while the target
            verifies, :mod:`disco.engines.predraft`).
        backend_tokens: the backend tokens callers must present (``authorization: Bearer``;
            the deployment's orchestrator holds the first), on top of mTLS when ``tls`` has a CA.
        insecure: serve on a non-loopback interface without TLS client authentication
            (``disco up --insecure``); refused otherwise (:class:`~protos.runtime.backend_security.BackendSecurity`).
    """

    def __init__(self, role: str, model: dict, host: str | None = None, limits: dict | None = None,
                 tls: dict | None = None, metrics: bool = False, overlap: bool = False,
                 backend_tokens: tuple[str, ...] = (), insecure: bool = False) -> None:
        import draft_service.server  # noqa: PLC0415 - torch-using modules after tune_cpu_math_env
        import target_service.server  # noqa: PLC0415
        from disco.config import ModelConfig  # noqa: PLC0415
        from disco.engines.sessions import SessionLimits  # noqa: PLC0415
        from disco.models.loading import disco_home, load_model  # noqa: PLC0415
        from disco.engines.engine_choice import choose_engine  # noqa: PLC0415
        from protos.runtime.backend_security import BackendSecurity  # noqa: PLC0415

        self.role = role
        host = host or ray.util.get_node_ip_address()
        self._tls = _tls(tls)
        security = BackendSecurity(tuple(backend_tokens), insecure=insecure)
        security.statement(host, self._tls)  # an exposed backend fails here, before its model loads
        model = {**model, "dtype": choose_engine(model.get("dtype", "auto"), model.get("spec"), role,
                                                 model.get("device", "cpu"), disco_home(), progress=False)}
        loaded = load_model(ModelConfig(**model), role, disco_home(), progress=False)
        module = draft_service.server if role == "draft" else target_service.server
        options = {"overlap": overlap} if role == "draft" else {}
        self._limits = SessionLimits(**(limits or {}))
        self._running = module.serve(loaded, host=host, port=0, limits=self._limits, tls=self._tls,
                                     metrics_port=0 if metrics else None, security=security, **options)
        if self._running.metrics is not None:
            self._running.metrics.describe_engine(model["dtype"], model.get("device", "cpu"), prefill=loaded.prefill)
        self._address = _advertised(host, self._running.port)
        self._service = f"disco.v1.{'DraftService' if role == 'draft' else 'TargetService'}"
        self._model = {"name": loaded.name, "dtype": model.get("dtype"), "device": model.get("device"),
                       **({"overlap": overlap} if role == "draft" else {})}

    def address(self) -> str:
        return self._address

    def describe(self) -> dict:
        return _describe(self.role, self._address, self._service, self._running, self._tls, model=self._model,
                         limits={"max_sessions": self._limits.max_sessions, "max_kv_bytes": self._limits.max_kv_bytes})

    def stop(self, grace_s: float = 2.0) -> None:
        """Drain the gRPC server (``disco down`` calls this before killing the actor)."""
        self._running.stop(grace_s)


class OrchestratorService:
    """The public orchestrator inside a Ray actor; it finds the draft and target
    replicas among the named actors of its namespace.

    Args:
        namespace: the Ray namespace of the deployment.
        tokenizer_spec: the target model (its tokenizer only).
        host: interface to bind (``None``: this node's IP).
        port: port to bind (0: any; a restarted instance then gets a new one).
        limits: :class:`orchestrator.servicer.OrchestratorLimits` fields.
        tls: ``{"cert", "key", "ca", "server_name"}`` PEM paths readable on this node:
            ``cert``/``key`` serve the public API over TLS and are the client identity towards
            the backends, ``ca`` verifies the backends. ``None``: plaintext.
        require_client_cert: public clients must present a certificate signed by ``tls["ca"]``.
        metrics: serve Prometheus ``/metrics`` on a free port of ``host``.
        http_port: also serve the OpenAI-compatible HTTP API on this port of ``host``
            (0: any; ``None``: none), in front of this orchestrator (docs/http.md).
        auth_tokens: the public API's bearer tokens (gRPC and HTTP; empty: none required).
        http_limits: the HTTP API's request limits (:class:`orchestrator.http.config.HttpConfig`
            fields ``max_tokens_limit``, ``max_concurrent``, ``max_queue``, ``timeout_s``).
        backend_token: the token presented to the draft and target replicas (their
            ``backend_tokens``; never one of ``auth_tokens``).
    """

    def __init__(self, namespace: str, tokenizer_spec: str | None, host: str | None = None, port: int = 0,
                 limits: dict | None = None, tls: dict | None = None, require_client_cert: bool = False,
                 metrics: bool = False, http_port: int | None = None, auth_tokens: tuple[str, ...] = (),
                 backend_token: str | None = None, http_limits: dict | None = None) -> None:
        from deploy.ray_resolver import RayResolver  # noqa: PLC0415
        from disco.models.loading import disco_home  # noqa: PLC0415
        from orchestrator.routing import ReplicaSet  # noqa: PLC0415
        from orchestrator.server import load_tokenizer, serve  # noqa: PLC0415
        from orchestrator.servicer import OrchestratorLimits  # noqa: PLC0415

        resolver = RayResolver(namespace)
        tokenizer = load_tokenizer(tokenizer_spec, disco_home())
        host = host or ray.util.get_node_ip_address()
        self._tls = _tls(tls)
        self._running = serve(tokenizer, ReplicaSet("draft", resolver), ReplicaSet("target", resolver),
                              host=host, port=port, limits=OrchestratorLimits(**(limits or {})), tls=self._tls,
                              require_client_cert=require_client_cert, auth_tokens=tuple(auth_tokens),
                              backend_token=backend_token, metrics_port=0 if metrics else None)
        self._address = _advertised(host, self._running.port)
        self._http = None
        if http_port is not None:
            from orchestrator.http.config import HttpConfig  # noqa: PLC0415 - the web stack only when asked
            from orchestrator.http.server import start_in_thread  # noqa: PLC0415

            self._http = start_in_thread(replace(HttpConfig.fronting(
                self._address, host, http_port, auth_tokens=tuple(auth_tokens),
                **{f"tls_{key}": value for key, value in (tls or {}).items()}), **(http_limits or {})))

    def address(self) -> str:
        return self._address

    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (``http://NODE_IP:PORT/v1``), if served."""
        if self._http is None:
            return None
        scheme = "https" if self._http.config.https else "http"
        return f"{scheme}://{_advertised(self._http.config.host, self._http.port)}/v1"

    def describe(self) -> dict:
        return _describe("orchestrator", self._address, "disco.v1.Orchestrator", self._running,
                         self._tls if self._tls is not None and self._tls.cert is not None else None,
                         routing=self.routing(), http=self.http_url())

    def routing(self) -> dict[str, list[dict]]:
        """Per-replica sessions and failures seen by this orchestrator."""
        return self._running.servicers[0].backends.routing()

    def stop(self, grace_s: float = 2.0) -> None:
        if self._http is not None:
            self._http.stop()
        self._running.stop(grace_s)
