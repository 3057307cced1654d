"""Arguments shared by several subcommands, and turning them into config objects."""

from __future__ import annotations

import argparse
import logging

from disco.config import DTYPE_CHOICES, ModelConfig, PairConfig
from disco.engines.engine_choice import choose_engine
from disco.models.loading import disco_home

DTYPE_HELP = ("engine: auto (default: bfloat16 on CUDA; on a CPU the fastest engine measured on this machine, "
              "timed at the first start and cached: int4, int8 or bfloat16 for the target, int4 or int8 for the "
              "draft), bfloat16, float16, float32 (to check exactness), int8 or int4 (weight-only, bfloat16 "
              "activations; int4 keeps a GGUF's own Q4_K weights)")


def add_dtype_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--dtype`` (default ``auto``); resolve it with :func:`dtype_from_args`."""
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES), help=DTYPE_HELP)


def dtype_from_args(args: argparse.Namespace, role: str = "target") -> str:
    """The concrete engine ``--dtype`` names for ``role`` on ``--device`` here (``auto``
    resolved once, on a CPU by timing the candidate engines on this machine:
    :func:`disco.engines.engine_choice.choose_engine`; ``--draft-dtype``, where given, for the draft)."""
    requested = getattr(args, "draft_dtype", None) if role == "draft" else None
    spec = getattr(args, role, None) if hasattr(args, role) else getattr(args, "model", None)
    return choose_engine(requested or args.dtype, spec, role, getattr(args, "device", "cpu"), disco_home())


def add_vocab_subset_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str) -> None:
    """The draft's vocabulary subset (:mod:`disco.models.vocab_subset`), 0 (default): all tokens."""
    parser.add_argument(flag, type=int, default=0, metavar="N",
                        help="the draft proposes from its N most frequent tokens only (an LM head over them: a "
                             "cheaper draft token; the target still verifies the full vocabulary, so the output "
                             "is unchanged); 0: all (default)")


def add_prefill_window_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str) -> None:
    """The draft's prefill window (:func:`disco.engines.kv.prefill_window_skip`), 0 (default): the whole prompt."""
    parser.add_argument(flag, type=int, default=0, metavar="N",
                        help="the draft reads at most N prompt tokens: the first 4 and the last N-4 (a long "
                             "prompt's draft prefill costs N tokens; the target still reads the whole prompt, so "
                             "the output is unchanged, acceptance may drop); 0: the whole prompt (default)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--target/--draft/--dtype/--device``; omitted models mean the default pair."""
    group = parser.add_argument_group("models")
    group.add_argument("--target", default=None,
                       help="target model: HF folder, hub id or .gguf file (default: the prepared default pair)")
    group.add_argument("--draft", default=None,
                       help="draft model: HF folder, hub id or .gguf file (default: the prepared default pair)")
    add_dtype_arg(group)
    group.add_argument("--draft-dtype", default=None, choices=list(DTYPE_CHOICES),
                       help="the draft's engine, where it should differ from --dtype")
    add_vocab_subset_arg(group, "--draft-vocab")
    add_prefill_window_arg(group, "--draft-window")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")


def pair_config_from_args(args: argparse.Namespace) -> PairConfig:
    """Both models' configs, with ``--dtype auto`` resolved into the engine used here."""
    pair = PairConfig(
        target=ModelConfig(spec=args.target, dtype=dtype_from_args(args, "target"), device=args.device),
        draft=ModelConfig(spec=args.draft, dtype=dtype_from_args(args, "draft"), device=args.device,
                          vocab_subset=getattr(args, "draft_vocab", 0),
                          prefill_window=getattr(args, "draft_window", 0)),
    )
    pair.target.validate()
    pair.draft.validate()
    return pair


def add_server_security_args(parser: argparse.ArgumentParser, orchestrator: bool = False) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` of a server (and the orchestrator's extra flags)."""
    group = parser.add_argument_group("security")
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="serve TLS with this certificate chain" + (
                           "; also the client certificate presented to the backends (mTLS)" if orchestrator else ""))
    group.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="CA that verifies the backends' certificates (connect to them over TLS)" if orchestrator
                       else "require client certificates signed by this CA (mutual TLS)")
    if orchestrator:
        group.add_argument("--tls-server-name", default=None, metavar="NAME",
                           help="name the backends' certificates carry, when it differs from their address's host")
        group.add_argument("--tls-require-client-cert", action="store_true",
                           help="also require public clients to present a certificate signed by --tls-ca")
        group.add_argument("--auth-token", default=None, metavar="TOKEN", help=argparse.SUPPRESS)
        add_auth_token_file_arg(group, "require `authorization: Bearer TOKEN` on the public API, TOKEN one of the "
                                       "file's lines (several API keys); health checks exempt")
    add_backend_security_args(group, orchestrator)


def add_auth_token_file_arg(group: argparse._ArgumentGroup, what: str) -> None:
    """``--auth-token-file``: the public API's token(s), one per line; read them with
    :func:`public_tokens_from_args` (else ``$DISCO_AUTH_TOKEN``; ``--auth-token`` is kept
    hidden for old scripts: a flag shows in ``ps``)."""
    group.add_argument("--auth-token-file", default=None, metavar="FILE",
                       help=f"{what} (default: $DISCO_AUTH_TOKEN; never put a token on a command line)")


def public_tokens_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The public API's tokens of ``--auth-token-file``, the hidden ``--auth-token`` or ``$DISCO_AUTH_TOKEN``."""
    from protos.runtime.auth import public_tokens  # noqa: PLC0415 - grpc only when used

    if getattr(args, "auth_token", None):
        logging.getLogger(__name__).warning(
            "--auth-token puts the token on the command line, where `ps` shows it to every user of this machine; "
            "use --auth-token-file or $DISCO_AUTH_TOKEN")
    return public_tokens(getattr(args, "auth_token", None), getattr(args, "auth_token_file", None))


def add_backend_security_args(group: argparse._ArgumentGroup, orchestrator: bool = False) -> None:
    """``--backend-token-file`` (both sides) and ``--insecure`` (backends): the backend credential."""
    group.add_argument("--backend-token-file", default=None, metavar="FILE",
                       help=("present the first token of FILE to the backends as `authorization: Bearer`" if orchestrator
                             else "accept only callers presenting one of FILE's tokens (one per line)")
                       + " (default: $DISCO_BACKEND_TOKEN); never the public API's token (docs/security.md)")
    if not orchestrator:
        group.add_argument("--insecure", action="store_true",
                           help="serve on a non-loopback interface without TLS client authentication (refused "
                                "otherwise): anyone who can reach the port can use the model; reported by Info "
                                "and /metrics")


def backend_security_from_args(args: argparse.Namespace):
    """The :class:`~protos.runtime.backend_security.BackendSecurity` of a backend's flags."""
    from protos.runtime.auth import backend_tokens  # noqa: PLC0415 - grpc only when used
    from protos.runtime.backend_security import BackendSecurity  # noqa: PLC0415

    return BackendSecurity(backend_tokens(args.backend_token_file), insecure=args.insecure)


def add_deployment_security_args(parser: argparse.ArgumentParser, title: str, require_client_cert: bool = False,
                                 token_note: str = "") -> None:
    """TLS and token flags of a command that starts all three services (``serve``, ``up``):
    every service gets the same files."""
    group = parser.add_argument_group(title)
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="certificate of all three services (the orchestrator's client identity too)")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="CA of the deployment: backends require client certificates it signed (mTLS), "
                            "the orchestrator verifies the backends with it")
    group.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="name in the certificate when it does not cover the services' addresses")
    if require_client_cert:
        group.add_argument("--tls-require-client-cert", action="store_true",
                           help="also require public clients to present a certificate signed by --tls-ca")
    group.add_argument("--auth-token", default=None, metavar="TOKEN", help=argparse.SUPPRESS)
    add_auth_token_file_arg(group, "bearer token(s) of the public API, one per line" + token_note)


def add_client_security_args(parser: argparse.ArgumentParser,
                             token_help: str = "bearer token of the server (the file's first line)") -> None:
    """TLS and token flags of a client of the public API."""
    group = parser.add_argument_group("connection security (with --server)")
    group.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="connect over TLS, verifying the server with this CA")
    group.add_argument("--tls-cert", default=None, metavar="PEM",
                       help="client certificate, for servers that require one (with --tls-key)")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="name to check the server certificate against (default: the host of --server)")
    group.add_argument("--auth-token", default=None, metavar="TOKEN", help=argparse.SUPPRESS)
    add_auth_token_file_arg(group, token_help)


def client_from_args(args: argparse.Namespace, timeout: float | None):
    """A :class:`~orchestrator.client.DiscoClient` for ``--server`` with the security flags."""
    from orchestrator.client import DiscoClient  # noqa: PLC0415 - grpc only when used

    tokens = public_tokens_from_args(args)
    return DiscoClient(args.server, timeout=timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                       auth_token=tokens[0] if tokens else None)


def add_operations_args(parser: argparse.ArgumentParser) -> None:
    """``--max-prompt-tokens``, ``--metrics-port`` and ``--log-format`` of a server."""
    parser.add_argument("--max-prompt-tokens", type=int, default=0,
                        help="longest prompt in tokens, else INVALID_ARGUMENT (default 0: only the model's "
                             "context limits it)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on this port of --host (0: any free port; default: off)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="stderr log lines as text with key=value fields, or one JSON object each")
