"""``disco target-server``, ``disco draft-server``, ``disco orchestrator`` (one service per
process, as Kubernetes and Ray run them) and ``disco serve`` (all three locally).

Every server prints one line when it listens (``--json``: ``{"service", "address",
"model", "pid", "metrics"}``, ``metrics`` being the ``/metrics`` address or null), logs
to stderr (``--log-format json``: one JSON object per line), and drains gracefully on
SIGTERM/SIGINT. Security and operations flags are described in docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Sequence

from disco.config import ModelConfig
from disco.engines.sessions import SessionLimits
from disco.errors import DiscoError
from disco_cli.commands.common import (
    add_deployment_security_args,
    add_dtype_arg,
    add_model_args,
    add_operations_args,
    add_server_security_args,
    add_prefill_window_arg,
    add_vocab_subset_arg,
    backend_security_from_args,
    dtype_from_args,
    pair_config_from_args,
    public_tokens_from_args,
)
from disco_cli.commands.http import add_http_limit_args, http_limits_from_args
from orchestrator.http import DEFAULT_HTTP_PORT

PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053}
#: ``disco serve`` restarts a service that exits, at most this many times per window (disco_cli.supervisor).
RESTARTS_PER_WINDOW = 5
RESTART_WINDOW_S = 600.0  # NOTE: RestartPolicy's default window


def register(subparsers: argparse._SubParsersAction) -> None:
    for role in ("target", "draft"):
        parser = subparsers.add_parser(f"{role}-server", help=f"run the {role} service (one model) over gRPC")
        parser.add_argument("--model", default=None,
                            help=f"{role} model: HF folder, hub id or .gguf file (default: the default pair's)")
        add_dtype_arg(parser)
        parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
        parser.add_argument("--no-engine-costs", action="store_true",
                            help="do not measure the model's forward costs at startup (they are measured once per "
                                 "model, engine, device and thread count and cached; see `disco models calibrate`)")
        parser.add_argument("--max-sessions", type=int, default=SessionLimits.max_sessions,
                            help=f"concurrent sessions (default {SessionLimits.max_sessions})")
        parser.add_argument("--idle-ttl", type=float, default=SessionLimits.idle_ttl_s,
                            help=f"seconds before an idle session is freed (default {SessionLimits.idle_ttl_s:.0f})")
        add_kv_budget_arg(parser)
        parser.add_argument("--static-slots", type=int, default=0, metavar="N",
                            help="sessions on the static path (fixed-shape steps over preallocated per-slot caches, "
                                 "CUDA graphs captured at start on a GPU; docs/static_step.md); 0: off (default). "
                                 "NOTE: not yet run on a GPU")
        parser.add_argument("--static-capacity", type=int, default=SessionLimits.static_capacity, metavar="TOKENS",
                            help=f"positions per static slot (default {SessionLimits.static_capacity}); a longer "
                                 "session takes the packed path")
        _add_threads_arg(parser)
        _add_listen_args(parser, PORTS[role])
        add_operations_args(parser)
        add_server_security_args(parser)
        if role == "draft":
            _add_artifact_dir_arg(parser)
            add_overlap_arg(parser)
            add_vocab_subset_arg(parser, "--vocab-subset")
            add_prefill_window_arg(parser, "--prefill-window")
        parser.set_defaults(func=_run_backend, role=role)

    parser = subparsers.add_parser("orchestrator", help="run the public orchestrator over a draft and a target service")
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="address of the target service")
    parser.add_argument("--draft", required=True, metavar="HOST:PORT", help="address of the draft service")
    parser.add_argument("--model", default=None,
                        help="the target model, for its tokenizer only (default: the default pair's target)")
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent requests (default 64)")
    parser.add_argument("--max-new-tokens-limit", type=int, default=4096,
                        help="largest max_new_tokens a request may ask for (default 4096)")
    _add_listen_args(parser, PORTS["orchestrator"])
    add_operations_args(parser)
    add_server_security_args(parser, orchestrator=True)
    parser.set_defaults(func=run_orchestrator)

    parser = subparsers.add_parser(
        "serve", help="start target, draft and orchestrator locally (one process each) and print the address",
        description="Starts the three services as child processes (default pair unless --target/--draft), "
                    "restarts one that exits (on its port, after a backoff; the others keep serving) and stops "
                    "them all on Ctrl-C or SIGTERM, or when one keeps crashing (--max-restarts).")
    add_model_args(parser)
    _add_threads_arg(parser)
    _add_listen_args(parser, PORTS["orchestrator"])
    add_operations_args(parser)
    add_kv_budget_arg(parser, " (each of the draft and target services)")
    _add_artifact_dir_arg(parser)
    add_overlap_arg(parser, "of the draft service")
    add_http_port_arg(parser)
    add_http_limit_args(parser, " (with --http-port)")
    parser.add_argument("--max-restarts", type=int, default=RESTARTS_PER_WINDOW, metavar="N",
                        help=f"restarts of one service allowed per {RESTART_WINDOW_S:.0f} s; one more exit stops "
                             f"everything (default {RESTARTS_PER_WINDOW}; a service that exits is restarted on its "
                             "port after a backoff of 1, 2, 4, ... 30 s)")
    parser.set_defaults(func=_run_serve)
    add_deployment_security_args(parser, "security (every child gets the same files)")


def add_kv_budget_arg(parser: argparse.ArgumentParser, whose: str = "") -> None:
    parser.add_argument("--max-kv-bytes", type=parse_bytes, default=0, metavar="BYTES",
                        help=f"KV-cache bytes all sessions together may hold{whose}, e.g. 8G or 512M; more gets "
                             "RESOURCE_EXHAUSTED (default 0: 80%% of the GPU's free memory after the model is "
                             "loaded, 50%% of the available RAM on a CPU; see docs/operations.md)")


def parse_bytes(text: str) -> int:
    """``4096``, ``512K``, ``64M``, ``8G`` or ``1T`` (powers of 1024; a trailing ``B``/``iB`` is allowed)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if value and value[-1] in "KMGT":
        scale, value = 1024 ** ("KMGT".index(value[-1]) + 1), value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 8G, 512M, 1048576)") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be >= 0, got {text!r}")
    return int(number * scale)


def _add_artifact_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifact-dir", action="append", default=None, metavar="DIR",
                        help="folder of DISCO artifacts that `disco:NAME` policies may name (repeatable; default "
                             "$DISCO_HOME/artifacts); a request can never make the draft open any other file")


def add_overlap_arg(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """``--overlap on|off`` (default off); read it with :func:`overlap_from_args`."""
    parser.add_argument("--overlap", choices=("on", "off"), default="off",
                        help=f"overlapped drafting{' ' + whose if whose else ''}: pre-draft each request's next "
                             "block while the target verifies the last one, used when the guess (whole block "
                             "accepted) is right; output unchanged (default off; docs/overlap.md)")


def add_http_port_arg(parser: argparse.ArgumentParser) -> None:
    """``--http-port`` (default: no HTTP API); see docs/http.md."""
    parser.add_argument("--http-port", type=int, default=None, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) "
                             f"on this port of --host, in front of the orchestrator (0: any free port; "
                             f"{DEFAULT_HTTP_PORT} is customary; default: off; docs/http.md)")


def overlap_from_args(args: argparse.Namespace) -> bool:
    return getattr(args, "overlap", "off") == "on"


def _add_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per model process (default: torch's choice)")


def _add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"port to bind, 0 for any free one (default {port})")
    parser.add_argument("--json", action="store_true", help="announce the bound address as one JSON line")


def _run_backend(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    import draft_service.server  # noqa: PLC0415 - grpc and torch are imported only when used
    import target_service.server  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415
    from protos.runtime.server import serve_until_signal  # noqa: PLC0415
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    _configure_logging(args.log_format)
    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)  # checked before the model loads
    if tls is not None and tls.cert is None:
        raise DiscoError("--tls-ca on a backend needs --tls-cert and --tls-key (its own certificate)")
    security = backend_security_from_args(args)
    security.statement(args.host, tls)  # an exposed backend is refused before its model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig(spec=args.model, dtype=dtype_from_args(args, args.role), device=args.device,
                         vocab_subset=getattr(args, "vocab_subset", 0),
                         prefill_window=getattr(args, "prefill_window", 0))
    config.validate()
    loaded, costs = _load_and_measure(config, args.role, measure=not args.no_engine_costs)
    limits = SessionLimits(max_sessions=args.max_sessions, idle_ttl_s=args.idle_ttl, max_kv_bytes=args.max_kv_bytes,
                           static_slots=args.static_slots, static_capacity=args.static_capacity)
    options = dict(host=args.host, port=args.port, limits=limits, max_prompt_tokens=args.max_prompt_tokens or None,
                   tls=tls, metrics_port=args.metrics_port, forward_s=costs.forward_s if costs else (),
                   prefill_s_per_token=costs.prefill_s / costs.context_tokens if costs else 0.0,
                   security=security)
    if args.role == "draft":
        running = draft_service.server.serve(
            loaded, artifact_dirs=args.artifact_dir or [disco_home() / "artifacts"], overlap=overlap_from_args(args),
            prefill_window=config.prefill_window, **options)
    else:
        running = target_service.server.serve(loaded, **options)
    if running.metrics is not None:
        running.metrics.describe_engine(config.dtype, config.device, costs.forward_s if costs else (), loaded.prefill)
    _announce(args.role, running.address, loaded.name, args.json, running.metrics_address)
    serve_until_signal([running])
    return 0


def _load_and_measure(config: ModelConfig, role: str, measure: bool = True):
    """Load the model, prove its packed forward (:mod:`disco.engines.packing_proof`) and, with
    ``measure``, its forward costs (cached; measured on the first start): the target's over
    every block up to the lookahead cap (:func:`disco.engines.engine_costs.request_for`), the
    draft's per token (``None`` if measuring fails or not asked).

    All under the machine's measurement lock, so that one service's timings never run next
    to another's model load (``disco serve`` starts both at once)."""
    from disco.engines import engine_costs  # noqa: PLC0415
    from disco.engines.batching import DEFAULT_MAX_BATCH  # noqa: PLC0415
    from disco.engines.machine_lock import machine_lock  # noqa: PLC0415
    from disco.engines.packing_proof import verdict_for  # noqa: PLC0415
    from disco.models.loading import disco_home, load_model  # noqa: PLC0415

    home = disco_home()
    with machine_lock(home):
        loaded = load_model(config, role, home)
        verdict_for(loaded.model, DEFAULT_MAX_BATCH)
        if not measure:
            return loaded, None
        try:
            costs = engine_costs.measure_loaded(loaded, config, role, home, progress=False, lock=False)
        except (DiscoError, RuntimeError) as error:  # NOTE: serving matters more than the numbers
            logging.getLogger(__name__).warning("could not measure the engine costs: %s", error)
            costs = None
    return loaded, costs


def run_orchestrator(args: argparse.Namespace, backend_interceptors: Sequence = ()) -> int:
    """``disco orchestrator``; ``backend_interceptors``: client interceptors on every call to
    the backends (the benchmarks' added latency, :mod:`disco_cli.bench.latency`)."""
    from disco.models.loading import disco_home  # noqa: PLC0415
    from orchestrator.server import load_tokenizer, serve  # noqa: PLC0415
    from orchestrator.servicer import OrchestratorLimits  # noqa: PLC0415
    from protos.runtime.auth import backend_tokens  # noqa: PLC0415
    from protos.runtime.server import serve_until_signal  # noqa: PLC0415
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    _configure_logging(args.log_format)
    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    tokens = public_tokens_from_args(args)
    backend_token = next(iter(backend_tokens(args.backend_token_file)), None)
    if backend_token is None and not (tls is not None and tls.cert is not None and tls.ca is not None):
        logging.getLogger(__name__).warning(
            "no backend credential (set $DISCO_BACKEND_TOKEN or --backend-token-file, or mTLS with --tls-cert, "
            "--tls-key and --tls-ca): only backends that accept anonymous callers on loopback will answer")
    tokenizer = load_tokenizer(args.model, disco_home())
    limits = OrchestratorLimits(max_new_tokens=args.max_new_tokens_limit, max_sessions=args.max_sessions,
                                max_prompt_tokens=args.max_prompt_tokens)
    running = serve(tokenizer, args.draft, args.target, host=args.host, port=args.port, limits=limits, tls=tls,
                    require_client_cert=args.tls_require_client_cert, auth_tokens=tokens,
                    backend_token=backend_token, metrics_port=args.metrics_port,
                    backend_interceptors=backend_interceptors)
    _warn_if_exposed(args.host, running.tls, bool(tokens), args.tls_require_client_cert)
    _announce("orchestrator", running.address, tokenizer.name_or_path, args.json, running.metrics_address)
    serve_until_signal([running])
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from disco_cli.launcher import ServiceOptions, launch  # noqa: PLC0415
    from disco_cli.supervisor import RestartPolicy, Supervisor  # noqa: PLC0415
    from protos.runtime.tls import TlsFiles  # noqa: PLC0415

    tls = TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca)  # fail here, not in three children
    if tls is not None and tls.cert is None:
        raise DiscoError("--tls-ca needs --tls-cert and --tls-key (the services' certificate)")
    tokens = public_tokens_from_args(args)  # read here: a bad file fails before any child starts
    options = ServiceOptions(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                             tls_server_name=args.tls_server_name,
                             auth_token=None if args.auth_token_file else next(iter(tokens), None),
                             auth_token_file=args.auth_token_file, metrics_port=args.metrics_port, max_prompt_tokens=args.max_prompt_tokens,
                             log_format=args.log_format, artifact_dirs=tuple(args.artifact_dir or ()),
                             max_kv_bytes=args.max_kv_bytes, max_new_tokens_limit=args.max_tokens_limit,
                             max_sessions=args.max_concurrent)
    services = launch(pair_config_from_args(args), host=args.host, port=args.port, threads=args.threads,
                      options=options, overlap=overlap_from_args(args))
    gateway = supervisor = None
    try:
        if args.http_port is not None:  # after the orchestrator is up: the gateway's first Info reaches it
            gateway = _start_http(args, services.addresses["orchestrator"], tokens)
        if args.json:  # with --metrics-port, also {"metrics": {service: HOST:PORT}}; with --http-port, "http"
            announced = {name: services.addresses[name] for name in ("orchestrator", "draft", "target")}
            if gateway is not None:
                announced["http"] = gateway.url
            print(json.dumps({**announced, "metrics": services.metrics} if services.metrics else announced),
                  flush=True)
        else:
            print(f"disco serving on {services.addresses['orchestrator']} (draft {services.addresses['draft']}, "
                  f"target {services.addresses['target']}); Ctrl-C stops all three", flush=True)
            if gateway is not None:
                print(f"OpenAI-compatible HTTP API on {gateway.url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        supervisor = Supervisor(services, RestartPolicy(max_restarts=args.max_restarts, window_s=RESTART_WINDOW_S))
        while not stop.wait(0.5):
            supervisor.poll()  # a service that exited is restarted; one that keeps crashing stops everything
            if gateway is not None and not gateway.alive():
                raise DiscoError("the HTTP gateway stopped; stopping the services")
    finally:
        if supervisor is not None:
            supervisor.close()
        if gateway is not None:
            gateway.stop()
        services.stop()
    return 0


def _start_http(args: argparse.Namespace, orchestrator: str, tokens: tuple[str, ...]):
    """The HTTP gateway in front of ``orchestrator``, in a thread of this process (HTTPS
    with the deployment's certificate, when it has one, and the HTTP limits of the command
    line); it accepts every public token."""
    from dataclasses import replace  # noqa: PLC0415

    from disco_cli.commands.http import warn_if_exposed  # noqa: PLC0415 - the web stack only when used
    from orchestrator.http.config import HttpConfig  # noqa: PLC0415
    from orchestrator.http.server import start_in_thread  # noqa: PLC0415

    config = replace(HttpConfig.fronting(orchestrator, args.host, args.http_port, tls_cert=args.tls_cert,
                                         tls_key=args.tls_key, tls_ca=args.tls_ca,
                                         tls_server_name=args.tls_server_name, auth_tokens=tokens),
                     **http_limits_from_args(args))
    gateway = start_in_thread(config)
    warn_if_exposed(args.host, config.https, tokens)
    return gateway


def _announce(service: str, address: str, model: str, as_json: bool, metrics: str | None = None) -> None:
    if as_json:
        print(json.dumps({"service": service, "address": address, "model": model, "pid": os.getpid(),
                          "metrics": metrics}), flush=True)
    else:
        print(f"{service} service ({model}) listening on {address}"
              + (f", metrics on http://{metrics}/metrics" if metrics else ""), flush=True)


def _warn_if_exposed(host: str, tls: bool, token: bool = False, client_certs: bool = False) -> None:
    """The public API beyond loopback without TLS (the token in clear), or open to anyone
    (no token, no client certificates), deserves a warning."""
    from protos.runtime.auth import is_loopback  # noqa: PLC0415

    if is_loopback(host):
        return
    logger = logging.getLogger(__name__)
    if not tls:
        logger.warning("listening on %s without TLS: requests and responses travel in clear (docs/security.md)", host)
        if token:
            logger.warning("the bearer token travels in clear text without TLS")
    if not token and not client_certs:
        logger.warning("the public API on %s takes no credential: anyone who can reach it can use it "
                       "(--auth-token-file or $DISCO_AUTH_TOKEN; docs/security.md)", host)


def _configure_logging(log_format: str = "text") -> None:
    from protos.runtime.logs import configure_logging  # noqa: PLC0415

    root = logging.getLogger()
    configure_logging(root.level if root.handlers else logging.INFO, log_format, sys.stderr)
