"""``disco http --server HOST:PORT``: the OpenAI-compatible HTTP API (docs/http.md) in
front of a running orchestrator; ``disco serve --http-port`` starts the same gateway
next to the orchestrator it starts."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from typing import Sequence

from disco_cli.commands.common import add_client_security_args, public_tokens_from_args
from orchestrator.http import DEFAULT_HTTP_PORT


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "http", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) in front of a "
                     "running orchestrator",
        description="Each HTTP request becomes one gRPC Generate call on the orchestrator (docs/http.md). "
                    "With API keys (--auth-token-file, one key per line, or $DISCO_AUTH_TOKEN), /v1/ requests "
                    "must carry `Authorization: Bearer KEY` with one of them, and the first key is sent on to "
                    "the orchestrator.")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="address of a running orchestrator")
    add_http_listen_args(parser)
    parser.add_argument("--json", action="store_true",
                        help='announce the bound address as one JSON line {"service": "http", "address", "url", '
                             '"server"}')
    add_client_security_args(parser, "API keys the gateway accepts, one per line; the first is presented to the "
                                     "orchestrator")
    parser.set_defaults(func=run)


def add_http_listen_args(parser: argparse.ArgumentParser) -> None:
    """``--host/--port`` of the gateway and its own options (the limits: :class:`HttpConfig`'s defaults)."""
    from orchestrator.http import config  # noqa: PLC0415 - imports no web stack

    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"port to bind, 0 for any free one (default {DEFAULT_HTTP_PORT})")
    parser.add_argument("--https-cert", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate chain (with --https-key; default plain HTTP)")
    parser.add_argument("--https-key", default=None, metavar="PEM", help="private key of --https-cert")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model name of /v1/models and of responses (default: the target model's name)")
    parser.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    parser.add_argument("--max-body-bytes", type=int, default=config.DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help=f"largest request body; a larger one gets 413 (default {config.DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--header-timeout", type=float, default=config.DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                        help="close a connection that has not sent a whole request head within S seconds "
                             f"(default {config.DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--keep-alive-timeout", type=float, default=config.DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                        metavar="S", help="close an idle keep-alive connection after S seconds "
                                          f"(default {config.DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=config.DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="answer 408 when a request body stalls S seconds "
                             f"(default {config.DEFAULT_BODY_TIMEOUT_S:g})")
    add_http_limit_args(parser, timeout_alias="--timeout")  # NOTE: the old name of --request-timeout


def add_http_limit_args(parser: argparse.ArgumentParser, whose: str = "", timeout_alias: str | None = None) -> None:
    """The gateway's request limits (``disco http`` and ``disco serve --http-port``); read
    them with :func:`http_limits_from_args`."""
    from orchestrator.http import config  # noqa: PLC0415 - imports no web stack

    parser.add_argument("--max-tokens-limit", type=int, default=config.DEFAULT_MAX_TOKENS_LIMIT, metavar="N",
                        help=f"largest max_tokens an HTTP request may ask for{whose}; more gets 400 (default "
                             f"{config.DEFAULT_MAX_TOKENS_LIMIT}, the orchestrator's --max-new-tokens-limit)")
    parser.add_argument("--max-concurrent", type=int, default=config.DEFAULT_MAX_CONCURRENT, metavar="N",
                        help=f"HTTP generation requests served at once{whose}; the next ones wait in the queue "
                             f"(default {config.DEFAULT_MAX_CONCURRENT}, the orchestrator's --max-sessions)")
    parser.add_argument("--max-queue", type=int, default=None, metavar="N",
                        help=f"HTTP requests that may wait for a slot{whose}, each up to its deadline; one more "
                             f"gets 429 (default {config.DEFAULT_QUEUE_PER_SLOT} x --max-concurrent; 0: no queue)")
    parser.add_argument("--request-timeout", *([timeout_alias] if timeout_alias else []), dest="request_timeout",
                        type=float, default=config.DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                        help=f"deadline of an HTTP request from its arrival{whose}, its wait in the queue included; "
                             f"past it the answer is 504 (default {config.DEFAULT_REQUEST_TIMEOUT_S:g})")


def http_limits_from_args(args: argparse.Namespace) -> dict:
    """The :class:`~orchestrator.http.config.HttpConfig` fields of :func:`add_http_limit_args`."""
    return {"max_tokens_limit": args.max_tokens_limit, "max_concurrent": args.max_concurrent,
            "max_queue": args.max_queue, "timeout_s": args.request_timeout}


def run(args: argparse.Namespace) -> int:
    from orchestrator.http.config import HttpConfig  # noqa: PLC0415 - the web stack only when used
    from orchestrator.http.server import start_in_thread  # noqa: PLC0415

    config = HttpConfig(args.server, host=args.host, port=args.port, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                        auth_tokens=public_tokens_from_args(args), https_cert=args.https_cert,
                        https_key=args.https_key, model_name=args.served_model_name, access_log=args.access_log,
                        max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                        keep_alive_timeout_s=args.keep_alive_timeout, body_timeout_s=args.body_timeout,
                        **http_limits_from_args(args))
    running = start_in_thread(config)
    warn_if_exposed(args.host, config.https, config.auth_tokens)
    if args.json:
        print(json.dumps({"service": "http", "address": running.address, "url": running.url,
                          "server": args.server}), flush=True)
    else:
        print(f"OpenAI-compatible API on {running.url} (orchestrator {args.server}); Ctrl-C stops it", flush=True)
    wait_for_signal(running)
    return 0


def wait_for_signal(running) -> None:
    """Block until SIGTERM or SIGINT (or the gateway stopping by itself), then stop it."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5) and running.alive():
            pass
    finally:
        running.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def warn_if_exposed(host: str, https: bool, tokens: str | Sequence[str] | None) -> None:
    """Binding beyond loopback without HTTPS (or with API keys in clear) deserves a warning."""
    if host in ("127.0.0.1", "localhost", "::1", "[::1]") or https:
        return
    logger = logging.getLogger(__name__)
    logger.warning("HTTP API on %s without HTTPS: anyone who can reach it can use it (see docs/http.md)", host)
    if tokens:
        logger.warning("the bearer token travels in clear text without HTTPS")
