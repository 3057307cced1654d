"""``disco up``, ``disco down``, ``disco status`` (the services as Ray actors) and
``disco ray-orchestrator`` (the orchestrator as a plain process that finds the services
through Ray, e.g. a Kubernetes Deployment next to a KubeRay cluster). See docs/deploy.md.

The commands over :mod:`deploy` (its actors, head and launcher); :mod:`disco_cli.main`
registers them like every other subcommand module.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import replace

from disco.errors import DiscoError
from disco_cli.commands.common import (add_deployment_security_args, add_dtype_arg, add_server_security_args,
                                       public_tokens_from_args)
from disco_cli.commands.http import add_http_limit_args, http_limits_from_args
from disco_cli.commands.serve import add_http_port_arg, add_overlap_arg, overlap_from_args, parse_bytes

DEFAULT_NAMESPACE = "disco"
DEFAULT_PORT = 50051


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="start draft, target and orchestrator as Ray actors and print the orchestrator's address",
        description="Deploys the services on Ray: a local Ray head by default (it keeps running after this "
                    "command returns; `disco down` stops it), or an existing cluster with --address.")
    parser.add_argument("--address", default=None, metavar="auto|HOST:PORT|ray://HOST:PORT",
                        help="Ray cluster to use (default: start a local one)")
    parser.add_argument("--target", default=None, help="target model: HF folder, hub id or .gguf file, readable on "
                        "every node (default: the default pair's)")
    parser.add_argument("--draft", default=None, help="draft model (default: the default pair's)")
    add_dtype_arg(parser)  # NOTE: auto is resolved by each replica, on its own node (GPU or CPU flags)
    for role in ("target", "draft"):
        parser.add_argument(f"--{role}-gpus", type=float, default=None, metavar="N",
                            help=f"GPUs per {role} replica (default: 1 if the cluster has GPUs, else 0)")
        parser.add_argument(f"--{role}-cpus", type=float, default=1.0, metavar="N",
                            help=f"CPUs per {role} replica (default 1)")
        parser.add_argument(f"--{role}-replicas", type=int, default=1, metavar="N",
                            help=f"{role} service replicas (default 1)")
        parser.add_argument(f"--{role}-resource", action="append", default=[], metavar="NAME=N",
                            help=f"a Ray custom resource each {role} replica needs, e.g. disco_{role}=1 (pins the "
                                 "role to the nodes or KubeRay worker group that advertise it); repeatable")
    parser.add_argument("--placement", default="spread", choices=["spread", "pair", "pack"],
                        help="spread: every replica on its own node; pair: draft i on the node of target i, the "
                             "pairs on different nodes (both: STRICT_SPREAD when the cluster has enough nodes, else "
                             "SPREAD, and `up` says so); pack: together (PACK). Default spread")
    parser.add_argument("--host", default=None,
                        help="interface the services bind (default: each node's IP; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"orchestrator port (default {DEFAULT_PORT}; 0: any free port)")
    parser.add_argument("--no-orchestrator", action="store_true",
                        help="start only draft and target (run `disco ray-orchestrator` elsewhere)")
    parser.add_argument("--placement-timeout", type=float, default=300.0, metavar="S",
                        help="how long to wait for the resources (default 300 s)")
    parser.add_argument("--max-restarts", type=int, default=-1, help="Ray restarts per actor (default -1: unlimited)")
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent sessions per replica (default 64)")
    parser.add_argument("--max-kv-bytes", type=parse_bytes, default=0, metavar="BYTES",
                        help="KV-cache bytes all sessions of one draft or target replica may hold, e.g. 8G "
                             "(default 0: derived from the replica's free memory, as `disco serve`)")
    parser.add_argument("--metrics", action="store_true",
                        help="each service serves Prometheus /metrics on a free port (`disco status` lists them)")
    add_overlap_arg(parser, "of the draft replicas")
    add_http_port_arg(parser)
    add_http_limit_args(parser, " (with --http-port; also the orchestrator's limits)")
    add_deployment_security_args(
        parser, "security (PEM paths readable on every node; every service gets the same files, as with "
        "`disco serve`)", require_client_cert=True,
        token_note="; they reach the orchestrator actor as constructor arguments (docs/deploy.md)")
    group = parser.add_argument_group("backend credential (docs/security.md)")
    group.add_argument("--backend-token-file", default=None, metavar="FILE",
                       help="the draft and target replicas accept FILE's tokens, the orchestrator presents the first "
                            "(default: $DISCO_BACKEND_TOKEN, else a fresh token per `disco up`); needed with "
                            "--no-orchestrator unless --tls-ca: give `disco ray-orchestrator` the same file")
    group.add_argument("--insecure", action="store_true",
                       help="let the draft and target replicas serve a non-loopback address without TLS client "
                            "authentication (refused otherwise: give --tls-cert/--tls-key/--tls-ca)")
    _add_namespace_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object {orchestrator, draft, target, ...}")
    parser.set_defaults(func=_run_up)

    parser = subparsers.add_parser("down", help="stop everything `disco up` started (actors, placement group, "
                                               "local Ray head)")
    _add_cluster_args(parser)
    parser.set_defaults(func=_run_down)

    parser = subparsers.add_parser("status", help="list the deployment's actors: node, resources, address, health")
    _add_cluster_args(parser)
    parser.set_defaults(func=_run_status)

    parser = subparsers.add_parser(
        "ray-orchestrator", help="run the orchestrator here, finding draft and target replicas through Ray",
        description="Serves at once (health SERVING); connects to Ray in the background and discovers the "
                    "replicas `disco up` started in the namespace (requests get UNAVAILABLE until then).")
    parser.add_argument("--address", default="auto", metavar="auto|ray://HOST:PORT",
                        help="Ray cluster (default auto; ray://... from outside the cluster)")
    parser.add_argument("--model", default=None, help="the target model, for its tokenizer only")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})")
    parser.add_argument("--json", action="store_true", help="announce the bound address as one JSON line")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port of --host (0: any free port; default: off)")
    add_http_port_arg(parser)
    add_http_limit_args(parser, " (with --http-port; also the orchestrator's limits)")
    add_server_security_args(parser, orchestrator=True)
    _add_namespace_arg(parser)
    parser.set_defaults(func=_run_ray_orchestrator)


def _add_namespace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                        help=f"Ray namespace of the deployment (default {DEFAULT_NAMESPACE})")


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="Ray cluster: auto, HOST:PORT or ray://HOST:PORT (default: the one `disco up` "
                             "recorded in $DISCO_HOME/ray/)")
    _add_namespace_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _run_up(args: argparse.Namespace) -> int:
    from deploy.ray_head import use_token_auth  # noqa: PLC0415 - ray is imported only when used

    use_token_auth(generate=args.address is None)  # a head we start always uses token auth
    from deploy.ray_launcher import UpConfig, up  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415
    from protos.runtime.auth import backend_tokens  # noqa: PLC0415
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)  # unreadable files: refused here, before Ray
    if args.tls_ca and not args.tls_cert:
        raise DiscoError("--tls-ca needs --tls-cert and --tls-key (the services' own certificate)")
    for role in ("target", "draft"):
        if getattr(args, f"{role}_replicas") < 1:
            raise DiscoError(f"--{role}-replicas must be >= 1")
        if getattr(args, f"{role}_cpus") <= 0:
            raise DiscoError(f"--{role}-cpus must be > 0")
    config = UpConfig(
        target=args.target, draft=args.draft, dtype=args.dtype, address=args.address, namespace=args.namespace,
        target_gpus=args.target_gpus, draft_gpus=args.draft_gpus, target_cpus=args.target_cpus,
        target_resources=_resources(args.target_resource, "target"),
        draft_resources=_resources(args.draft_resource, "draft"),
        draft_cpus=args.draft_cpus, target_replicas=args.target_replicas, draft_replicas=args.draft_replicas,
        placement=args.placement, host=args.host, port=args.port, orchestrator=not args.no_orchestrator,
        max_restarts=args.max_restarts, max_sessions=args.max_sessions, max_kv_bytes=args.max_kv_bytes,
        placement_timeout_s=args.placement_timeout,
        tls_cert=_absolute(args.tls_cert), tls_key=_absolute(args.tls_key), tls_ca=_absolute(args.tls_ca),
        tls_server_name=args.tls_server_name, tls_require_client_cert=args.tls_require_client_cert,
        metrics=args.metrics, overlap=overlap_from_args(args), http_port=args.http_port,
        http_limits=http_limits_from_args(args), insecure=args.insecure,
        backend_tokens=backend_tokens(args.backend_token_file))
    result = up(config, disco_home(), public_tokens_from_args(args))
    print(json.dumps(result) if args.json else up_report(result), flush=True)
    return 0


def up_report(result: dict) -> str:
    """What ``disco up`` prints (without ``--json``)."""
    lines = [f"disco is up in Ray namespace {result['namespace']!r} ({result['ray_address']}, "
             f"placement {result['placement']})"]
    if result.get("placement_note"):
        lines.append(f"  note: {result['placement_note']}")
    lines.append(f"  orchestrator  {result['orchestrator'] or '(not started)'}")
    if result.get("http"):
        lines.append(f"  http          {result['http']} (OpenAI-compatible API)")
    for role in ("target", "draft"):
        lines.append(f"  {role:<12}  {', '.join(result[role])}")
    lines.append("`disco status` shows the actors, `disco down` stops everything.")
    return "\n".join(lines)


def _resources(items: list[str], role: str) -> dict[str, float]:
    """``["NAME=N", ...]`` -> ``{NAME: N}`` (``--target-resource`` / ``--draft-resource``)."""
    resources = {}
    for item in items:
        name, _, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not name or value <= 0 or name in ("CPU", "GPU"):
            raise DiscoError(f"--{role}-resource takes NAME=N with N > 0 and a custom resource name (CPU and GPU "
                             f"have their own flags), got {item!r}")
        resources[name] = value
    return resources


def _absolute(path: str | None) -> str | None:
    """Actors run in other working directories: pass them absolute paths."""
    return os.path.abspath(path) if path else None


def _run_down(args: argparse.Namespace) -> int:
    from deploy.ray_head import use_token_auth  # noqa: PLC0415

    use_token_auth(generate=False)
    from deploy.ray_launcher import down  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415

    result = down(args.address, args.namespace, disco_home())
    if args.json:
        print(json.dumps(result))
    else:
        removed = ", ".join(result["removed"]) or "nothing"
        head = "; local Ray head stopped" if result["ray_head_stopped"] else ""
        print(f"removed {removed} from Ray namespace {result['namespace']!r}{head}")
    return 0 if not result["remaining"] and not result["placement_group_left"] else 1


def _run_status(args: argparse.Namespace) -> int:
    from deploy.ray_head import use_token_auth  # noqa: PLC0415

    use_token_auth(generate=False)
    from deploy.ray_launcher import status  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415

    result = status(args.address, args.namespace, disco_home())
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Ray namespace {result['namespace']!r} at {result['ray_address']}")
    if not result["actors"]:
        print("  no disco actors (run `disco up`)")
    for actor in result["actors"]:
        resources = ", ".join(f"{k}={v:g}" for k, v in sorted(actor.get("resources", {}).items())) or "-"
        restarted = " (restarted)" if actor.get("restarted") else ""
        node = f"{actor.get('node_ip', '-')} {actor.get('node_id', '-')[:12]}"
        print(f"  {actor['name']:<13} {actor.get('address', '-'):<22} node {node:<28} "
              f"[{resources}] {actor['health']}{restarted}{' tls' if actor.get('tls') else ''}"
              f"{' metrics ' + actor['metrics'] if actor.get('metrics') else ''}"
              f"{' http ' + actor['http'] if actor.get('http') else ''}")
    group = result["placement_group"]
    if group:
        print(f"  placement group {group['name']}: {group['strategy']}, {group['state']}")
    return 0


def _run_ray_orchestrator(args: argparse.Namespace) -> int:
    from deploy.ray_head import use_token_auth  # noqa: PLC0415

    use_token_auth(generate=False)
    from grpc_health.v1 import health_pb2  # noqa: PLC0415

    from deploy.ray_resolver import RayResolver  # noqa: PLC0415
    from disco.errors import Unavailable  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415
    from orchestrator.routing import ReplicaSet  # noqa: PLC0415
    from orchestrator.server import load_tokenizer, serve  # noqa: PLC0415
    from orchestrator.http.config import orchestrator_limits_for  # noqa: PLC0415 - imports no web stack
    from orchestrator.servicer import SERVICE_NAME, OrchestratorLimits  # noqa: PLC0415
    from protos.runtime.auth import backend_tokens  # noqa: PLC0415
    from protos.runtime.server import serve_until_signal  # noqa: PLC0415
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    resolver = RayResolver(args.namespace, args.address)
    tokenizer = load_tokenizer(args.model, disco_home())
    tokens = public_tokens_from_args(args)
    backend = backend_tokens(args.backend_token_file)  # the one `disco up` gave the replicas
    running = serve(tokenizer, ReplicaSet("draft", resolver), ReplicaSet("target", resolver),
                    host=args.host, port=args.port, tls=tls, require_client_cert=args.tls_require_client_cert,
                    auth_tokens=tokens, backend_token=backend[0] if backend else None,
                    metrics_port=args.metrics_port,
                    limits=OrchestratorLimits(**orchestrator_limits_for(http_limits_from_args(args))))
    gateway = None
    if args.http_port is not None:  # the OpenAI-compatible API, in front of this orchestrator (docs/http.md)
        from orchestrator.http.config import HttpConfig, local_address  # noqa: PLC0415
        from orchestrator.http.server import start_in_thread  # noqa: PLC0415

        gateway = start_in_thread(replace(HttpConfig.fronting(
            local_address(args.host, running.port), args.host, args.http_port, tls_cert=args.tls_cert,
            tls_key=args.tls_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name, auth_tokens=tokens),
            **http_limits_from_args(args)))
    # Readiness: the service is NOT_SERVING until Ray is reachable; the server's overall
    # health ("") stays SERVING (liveness).
    running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    if args.json:
        print(json.dumps({"service": "orchestrator", "address": running.address, "model": tokenizer.name_or_path,
                          "pid": os.getpid(), **({"http": gateway.url} if gateway else {})}), flush=True)
    else:
        print(f"orchestrator listening on {running.address}; Ray namespace {args.namespace!r} at {args.address}"
              + (f"; OpenAI-compatible API on {gateway.url}" if gateway else ""), flush=True)
    while True:  # serve at once; connect to Ray when it is there (requests get UNAVAILABLE meanwhile)
        try:
            resolver.connect()
            break
        except Unavailable as error:
            logging.getLogger(__name__).warning("%s; retrying in 5 s", error)
            time.sleep(5.0)
    running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    try:
        serve_until_signal([running])
    finally:
        if gateway is not None:
            gateway.stop()
    return 0
