"""``disco up``, ``disco down`` and ``disco status`` over Ray's public API.

``up`` connects to a cluster (or starts a local head, see :mod:`deploy.ray_head`),
reserves one placement-group bundle per service replica, starts the draft and target
replicas as named, detached, restartable actors in their bundles, then the orchestrator
actor on the head node, and returns their addresses. Everything lives in one Ray
namespace (default ``disco``): ``down`` and ``status`` find it there by name.

Credentials: the draft and target replicas accept only callers that present the
deployment's backend token (a fresh one per ``up``, unless one is given) and, with
``--tls-ca``, a client certificate (mTLS); the orchestrator actor holds that token and
requires the public API's tokens. All of them travel as actor constructor arguments (see
:mod:`deploy.ray_actors`), never in a runtime environment, a log or a command line.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy import ray_head
from deploy.ray_actors import ModelService, OrchestratorService
from deploy.ray_resolver import ORCHESTRATOR_NAME, actor_names, replica_name, role_of
from orchestrator.http.config import orchestrator_limits_for
from disco.errors import DiscoError
from protos.runtime.auth import new_token
from protos.runtime.backend_security import BackendSecurity
from protos.runtime.tls import TlsFiles

logger = logging.getLogger(__name__)


class _DropExpectedWarning(logging.Filter):
    """NOTE: Ray warns that a restartable detached actor in a placement group is killed
    for good when the group is removed; that is what ``disco down`` does on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "restartable detached actor with a placement group" not in record.getMessage()


logging.getLogger("ray.actor").addFilter(_DropExpectedWarning())

#: ``spread``: every replica on its own node; ``pair``: draft i next to target i, the pairs on
#: different nodes; ``pack``: as few nodes as possible (docs/deploy.md: when to choose which).
PLACEMENTS = ("spread", "pair", "pack")
STARTUP_TIMEOUT_S = 1800.0  # preparing the default pair on first use downloads ~1.6 GB
DESCRIBE_TIMEOUT_S = 10.0
PLACEMENT_TIMEOUT_S = 300.0  # resources in use elsewhere, or nodes an autoscaler is adding


@dataclass(frozen=True)
class UpConfig:
    """What ``disco up`` deploys (``None`` GPUs: 1 per service if the cluster has GPUs, else 0)."""

    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"  # each replica resolves "auto" on its own node (disco.platform.resolve_dtype)
    address: str | None = None  # None: start a local Ray head
    namespace: str = "disco"
    target_gpus: float | None = None
    draft_gpus: float | None = None
    target_cpus: float = 1.0
    draft_cpus: float = 1.0
    target_replicas: int = 1
    draft_replicas: int = 1
    # Ray custom resources per replica, e.g. {"disco_target": 1}: pins a role to the nodes (or
    # KubeRay worker group) that advertise them (deploy/kuberay/raycluster.yaml).
    target_resources: dict[str, float] = field(default_factory=dict)
    draft_resources: dict[str, float] = field(default_factory=dict)
    placement: str = "spread"
    host: str | None = None  # None: each node's IP
    port: int = 50051
    orchestrator: bool = True
    max_restarts: int = -1  # -1: restart forever
    max_sessions: int = 64
    max_kv_bytes: int = 0  # each draft/target replica's KV-cache budget in bytes (0: derived from its memory)
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    # TLS: PEM paths readable on every node (a shared volume, the image, a mounted Secret);
    # every service gets the same files, as with `disco serve` (docs/operations.md).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    tls_require_client_cert: bool = False
    metrics: bool = False  # each service serves /metrics on a free port (`disco status` lists them)
    overlap: bool = False  # draft replicas pre-draft the next block while the target verifies (disco.engines.predraft)
    http_port: int | None = None  # the orchestrator actor also serves the OpenAI-compatible HTTP API (docs/http.md)
    # The request limits of that API (HttpConfig fields: max_tokens_limit, max_concurrent,
    # max_queue, timeout_s; `disco up --max-tokens-limit ...`); the orchestrator actor takes
    # max_tokens_limit and max_concurrent as its own max_new_tokens and max_sessions, as
    # `disco serve` does. Empty: the defaults.
    http_limits: dict[str, float | int | None] = field(default_factory=dict)
    # Backends on a non-loopback interface without TLS client authentication: refused unless insecure.
    insecure: bool = False
    # The tokens the draft and target replicas accept (the orchestrator presents the first):
    # `--backend-token-file` / $DISCO_BACKEND_TOKEN, needed when the orchestrator runs elsewhere
    # (`disco ray-orchestrator`); empty: a fresh token per `up` when the orchestrator actor is
    # started. A secret: kept out of repr (logs, tracebacks).
    backend_tokens: tuple[str, ...] = field(default=(), repr=False)

    def tls_paths(self) -> dict | None:
        paths = {"cert": self.tls_cert, "key": self.tls_key, "ca": self.tls_ca}
        if not any(paths.values()):
            return None
        return {**paths, "server_name": self.tls_server_name}


def up(config: UpConfig, home: Path, auth_tokens: str | Sequence[str] | None = None) -> dict:
    """Deploy; returns ``{"orchestrator": HOST:PORT | None, "draft": [...], "target": [...], ...}``.

    Args:
        config: what to deploy (``config.backend_tokens``: the backends' credential).
        home: ``$DISCO_HOME`` (the deployment's record, the local head's log).
        auth_tokens: bearer tokens the orchestrator requires on the public API (none: no check).

    Raises:
        DiscoError: a deployment already runs in the namespace, a backend would be reachable
            without credentials (before anything starts), the placement group cannot be
            scheduled, or a service fails to start (then everything started is removed).
    """
    public = (auth_tokens,) if isinstance(auth_tokens, str) else tuple(auth_tokens or ())
    security = _backend_security(config, public, tuple(config.backend_tokens))
    if config.host is not None:
        _check_exposure(security, config, [config.host])
    head = None
    address = config.address
    previous = ray_head.load_state(home, config.namespace)
    if previous is not None and previous.head_pid and ray_head.head_running(previous.head_pid):
        raise DiscoError(f"disco is already up in Ray namespace {config.namespace!r} (local Ray head pid "
                         f"{previous.head_pid}); run `disco down` first or choose another --namespace")
    if address is None:
        if (not ray_head.use_token_auth(generate=True) and ray_head.token_available()
                and ray_head.AUTH_MODE_VARIABLE not in os.environ):
            raise DiscoError("the local Ray head uses token authentication: set RAY_AUTH_MODE=token before "
                             "importing ray (or call deploy.ray_head.use_token_auth(generate=True) first)")
        cpus = math.ceil(config.target_cpus * config.target_replicas + config.draft_cpus * config.draft_replicas)
        head = ray_head.start_local_head(home, max(os.cpu_count() or 1, cpus), config.namespace)
        address = head.address
    state = ray_head.DeploymentState(config.namespace, address, head.process.pid if head else None,
                                     str(head.log_path) if head else None, head.client_address if head else None)
    deploying = False  # from here on, what fails is ours to remove
    try:
        ray_head.connect(address, config.namespace, head.process if head else None,
                         log_path=head.log_path if head else None)
        existing = actor_names(config.namespace)
        if existing:
            raise DiscoError(f"Ray namespace {config.namespace!r} already runs {', '.join(existing)}; "
                             "run `disco down` first or choose another --namespace")
        if config.host is None:  # each replica binds its node's IP
            _check_exposure(security, config, [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]])
        deploying = True
        ray_head.save_state(home, state)
        result = _deploy(config, public, security)
        state.orchestrator = result["orchestrator"]
        ray_head.save_state(home, state)
        return {**result, "namespace": config.namespace, "ray_address": address,
                "ray_client_address": state.ray_client_address, "ray_head_pid": state.head_pid}
    except BaseException:
        if deploying:
            _teardown(config.namespace)
            ray_head.remove_state(home, config.namespace)
        if head is not None:
            ray.shutdown()
            ray_head.stop_local_head(head.process.pid)
        raise


@dataclass(frozen=True)
class _Replica:
    role: str
    index: int
    cpus: float
    gpus: float
    resources: dict  # Ray custom resources
    bundle: int  # its placement-group bundle

    def demand(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **self.resources}


def _replicas(config: UpConfig, cluster_has_gpus: bool) -> tuple[list[_Replica], list[dict[str, float]]]:
    """The replicas to start and the placement-group bundles they go in: one bundle per
    replica, or (``pair``) one per draft/target pair, holding both."""
    if config.placement not in PLACEMENTS:
        raise DiscoError(f"placement must be one of {', '.join(PLACEMENTS)}, got {config.placement!r}")
    if config.placement == "pair" and config.target_replicas != config.draft_replicas:
        raise DiscoError(f"placement pair puts draft i next to target i: it needs as many draft as target replicas "
                         f"(got {config.draft_replicas} and {config.target_replicas})")
    replicas, bundles = [], []
    for role, count, cpus, gpus, resources in (
            ("target", config.target_replicas, config.target_cpus, _gpus(config.target_gpus, cluster_has_gpus),
             config.target_resources),
            ("draft", config.draft_replicas, config.draft_cpus, _gpus(config.draft_gpus, cluster_has_gpus),
             config.draft_resources)):
        for index in range(count):
            bundle = index if config.placement == "pair" else len(replicas)
            replica = _Replica(role, index, cpus, gpus, dict(resources), bundle)
            if bundle == len(bundles):
                bundles.append({})
            for key, amount in replica.demand().items():
                bundles[bundle][key] = bundles[bundle].get(key, 0.0) + amount
            replicas.append(replica)
    return replicas, bundles


def _backend_security(config: UpConfig, public: tuple[str, ...], tokens: tuple[str, ...]) -> BackendSecurity:
    """The credentials of the deployment's backends: ``tokens``, else a fresh token when
    the orchestrator actor is started here (it alone will hold it).

    Raises:
        DiscoError: a backend token is a public token, or no orchestrator would hold a credential.
    """
    if set(tokens) & set(public):
        raise DiscoError("the backend token must differ from the public API's tokens (a public client would "
                         "otherwise reach the draft and target services)")
    if not tokens and config.orchestrator:
        tokens = (new_token(),)
    if not tokens and not config.tls_ca and not config.insecure:
        raise DiscoError("--no-orchestrator: the orchestrator you run elsewhere needs the backends' credential; "
                         "give one with --backend-token-file (or $DISCO_BACKEND_TOKEN), the same for "
                         "`disco ray-orchestrator`, or mTLS with --tls-ca")
    return BackendSecurity(tokens, insecure=config.insecure)


def _check_exposure(security: BackendSecurity, config: UpConfig, hosts: list[str]) -> None:
    """Refuse (:meth:`BackendSecurity.statement`) before any actor starts when a replica
    would bind a non-loopback address of ``hosts`` without TLS client authentication."""
    tls = TlsFiles.from_paths(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
    for host in dict.fromkeys(hosts):
        statement = security.statement(host, tls)
        if statement.startswith("INSECURE"):
            logger.warning("disco up --insecure: the draft and target replicas are %s", statement)
            return


def _deploy(config: UpConfig, public: tuple[str, ...], security: BackendSecurity) -> dict:
    replicas, bundles = _replicas(config, ray.cluster_resources().get("GPU", 0) > 0)
    strategy, note = _strategy(config.placement, bundles, ray.nodes())
    if note:
        logger.warning("%s", note)
    group = ray.util.placement_group(bundles, strategy=strategy, name=_group_name(config.namespace),
                                     lifetime="detached")
    _await_placement(group, bundles, strategy, config.placement_timeout_s)
    service = ray.remote(ModelService)
    handles = {}
    for replica in replicas:
        role = replica.role
        model = {"spec": config.target if role == "target" else config.draft, "dtype": config.dtype,
                 "device": "cuda" if replica.gpus else "cpu"}
        handles[replica_name(role, replica.index)] = service.options(
            name=replica_name(role, replica.index), lifetime="detached", max_restarts=config.max_restarts,
            num_cpus=replica.cpus, num_gpus=replica.gpus, resources=replica.resources or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=replica.bundle),
        ).remote(role, model, config.host, {"max_sessions": config.max_sessions, "max_kv_bytes": config.max_kv_bytes},
                 config.tls_paths(), config.metrics, overlap=config.overlap and role == "draft",
                 backend_tokens=security.tokens, insecure=security.insecure)
    addresses = {name: _await(name, handle, config.startup_timeout_s) for name, handle in handles.items()}
    orchestrator = http = None
    if config.orchestrator:
        handle = ray.remote(OrchestratorService).options(
            name=ORCHESTRATOR_NAME, lifetime="detached", max_restarts=config.max_restarts, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
        ).remote(config.namespace, config.target, config.host, config.port, orchestrator_limits_for(config.http_limits),
                 config.tls_paths(), config.tls_require_client_cert, config.metrics, config.http_port,
                 auth_tokens=public, backend_token=security.tokens[0] if security.tokens else None,
                 http_limits=dict(config.http_limits))
        orchestrator = _await(ORCHESTRATOR_NAME, handle, config.startup_timeout_s)
        http = ray.get(handle.http_url.remote(), timeout=DESCRIBE_TIMEOUT_S)
    return {"orchestrator": orchestrator, "http": http, "placement": strategy, "placement_note": note,
            "target": [a for n, a in addresses.items() if n.startswith("target")],
            "draft": [a for n, a in addresses.items() if n.startswith("draft")]}


def _await_placement(group, bundles: list[dict], strategy: str, timeout_s: float) -> None:
    """Wait until the placement group is scheduled, saying what it waits for.

    Raises:
        DiscoError: not scheduled within ``timeout_s``.
    """
    if group.wait(timeout_seconds=min(5.0, timeout_s)):
        return
    needed: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            needed[key] = needed.get(key, 0.0) + amount

    def describe(resources: dict) -> str:
        return ", ".join(f"{key}={resources.get(key, 0):g}" for key in sorted(needed))

    shortage = (f"needs {describe(needed)} ({strategy}); the cluster has {describe(ray.cluster_resources())} "
                f"in total, {describe(ray.available_resources())} free")
    logger.warning("waiting up to %.0f s for the placement group: %s", timeout_s, shortage)
    if not group.wait(timeout_seconds=max(0.0, timeout_s - 5.0)):
        raise DiscoError(f"the placement group could not be scheduled within {timeout_s:.0f} s: {shortage}; "
                         "free resources (another deployment? see `disco status --namespace ...`) or ask for less")


def _gpus(requested: float | None, cluster_has_gpus: bool) -> float:
    return requested if requested is not None else (1.0 if cluster_has_gpus else 0.0)


def _strategy(placement: str, bundles: list[dict], nodes: list[dict]) -> tuple[str, str]:
    """The Ray strategy for ``placement`` over ``bundles`` on ``nodes`` (``ray.nodes()``), and
    a note when it is less than asked ("" otherwise). ``spread`` / ``pair``: STRICT_SPREAD
    (every bundle on its own node) when the alive nodes can hold the bundles one per node,
    else SPREAD (best effort); ``pack``: PACK."""
    if placement == "pack":
        return "PACK", ""
    hosted = _one_per_node(bundles, [node["Resources"] for node in nodes if node["Alive"]])
    if hosted == len(bundles):
        return "STRICT_SPREAD", ""
    what = "draft/target pairs" if placement == "pair" else "service replicas"
    return "SPREAD", (f"placement {placement}: {len(bundles)} {what} but the alive nodes can hold only {hosted} of "
                      "them one per node; using SPREAD (best effort: some share a node, and a lost node takes "
                      "all of them)")


def _one_per_node(bundles: list[dict], nodes: list[dict]) -> int:
    """How many of ``bundles`` fit on distinct nodes (``nodes``: their total resources):
    a maximum bipartite matching, by augmenting paths (Kuhn's algorithm)."""
    fits = [[n for n, resources in enumerate(nodes)
             if all(resources.get(key, 0) >= amount for key, amount in bundle.items())] for bundle in bundles]
    holder: dict[int, int] = {}  # node -> bundle

    def place(bundle: int, seen: set[int]) -> bool:
        for node in fits[bundle]:
            if node not in seen:
                seen.add(node)
                if node not in holder or place(holder[node], seen):
                    holder[node] = bundle
                    return True
        return False

    return sum(place(bundle, set()) for bundle in range(len(bundles)))


def _head_node_id() -> str:
    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def _await(name: str, handle, timeout_s: float) -> str:
    try:
        return ray.get(handle.address.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise DiscoError(f"the {name} service did not start within {timeout_s:.0f} s") from None
    except ray.exceptions.RayError as error:
        raise DiscoError(f"the {name} service failed to start: {_cause(error)}") from None


def _cause(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line or "error:" in line]
    return (errors or lines or [type(error).__name__])[-1]


def _teardown(namespace: str) -> list[str]:
    """Stop and kill every named actor of ``namespace`` and remove the placement group."""
    if not ray.is_initialized():
        return []
    names = actor_names(namespace)
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
    stops = {name: handle.stop.remote() for name, handle in handles.items()}
    ray.wait(list(stops.values()), num_returns=len(stops), timeout=10.0)  # drain gRPC servers, best effort
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(_group_name(namespace)))
    except ValueError:
        pass  # no such placement group
    deadline = time.monotonic() + 30.0
    while actor_names(namespace) and time.monotonic() < deadline:
        time.sleep(0.2)
    return names


def down(address: str | None, namespace: str, home: Path) -> dict:
    """Remove what ``up`` started in ``namespace``: actors, placement group, and the local
    Ray head if ``up`` started one. Returns what was removed and what remains (nothing)."""
    state = ray_head.load_state(home, namespace)
    address = _cluster_address(address, state, home, namespace)
    head_pid = state.head_pid if state else None
    try:
        ray_head.connect(address, namespace, timeout_s=0)
    except DiscoError:
        if head_pid is None:
            raise
        killed, remaining, group_left = [], [], False  # the head died: so did everything in it
    else:
        killed = _teardown(namespace)
        remaining = actor_names(namespace)
        group_left = _placement_group_exists(namespace)
    ray.shutdown()
    head_stopped = ray_head.stop_local_head(head_pid) if head_pid else False
    ray_head.remove_state(home, namespace)
    return {"namespace": namespace, "ray_address": address, "removed": killed, "remaining": remaining,
            "placement_group_left": group_left, "ray_head_stopped": head_stopped}


def _group_name(namespace: str) -> str:
    return f"disco-services-{namespace}"


def _cluster_address(address: str | None, state: ray_head.DeploymentState | None, home: Path,
                     namespace: str) -> str:
    if address:
        return address
    if state is None:
        raise DiscoError(f"no deployment of Ray namespace {namespace!r} is recorded in "
                         f"{ray_head.state_path(home, namespace)}; pass --address (e.g. auto) to look in a cluster")
    return state.ray_address


def _placement_group_exists(namespace: str) -> bool:
    try:
        group = ray.util.get_placement_group(_group_name(namespace))
    except ValueError:
        return False
    return ray.util.placement_group_table(group).get("state") not in (None, "REMOVED")


def status(address: str | None, namespace: str, home: Path) -> dict:
    """Every actor of the deployment (role, node, resources, address, health, restarts)
    and the placement group's strategy, state and bundle nodes."""
    address = _cluster_address(address, ray_head.load_state(home, namespace), home, namespace)
    ray_head.connect(address, namespace, timeout_s=0)
    actors = []
    for name in actor_names(namespace):
        if role_of(name) is None:
            continue
        try:
            actors.append(ray.get(ray.get_actor(name, namespace=namespace).describe.remote(),
                                  timeout=DESCRIBE_TIMEOUT_S))
        except (ray.exceptions.RayError, ValueError) as error:
            actors.append({"name": name, "role": role_of(name), "health": f"UNAVAILABLE ({_cause(error)})"})
    group = None
    if _placement_group_exists(namespace):
        table = ray.util.placement_group_table(ray.util.get_placement_group(_group_name(namespace)))
        group = {"name": _group_name(namespace), "strategy": table.get("strategy"), "state": table.get("state"),
                 "bundles": table.get("bundles"), "bundle_nodes": table.get("bundles_to_node_id")}
    orchestrator = next((a.get("address") for a in actors if a["role"] == "orchestrator"), None)
    return {"namespace": namespace, "ray_address": address, "orchestrator": orchestrator, "actors": actors,
            "placement_group": group}
