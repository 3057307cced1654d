"""``disco info --server HOST:PORT [--json]``: capabilities and load of a running deployment."""

from __future__ import annotations

import argparse
import json
import sys

from disco_cli.commands.common import add_client_security_args, client_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="show the models, policies, limits and active sessions of a server")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="address of a running orchestrator")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"active_sessions": {"orchestrator", "draft", "target"}, ...}')
    add_client_security_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from orchestrator.client import DiscoRpcError  # noqa: PLC0415 - grpc only when used

    try:
        with client_from_args(args, args.timeout) as client:
            info = client.info()
    except DiscoRpcError as error:
        print(f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info))
        return 0
    active = info["active_sessions"]
    print(f"disco-serve {info['version']} at {args.server}")
    for role in ("target", "draft"):
        model = info["models"][role]
        engine = f"{model['dtype']} {model['kernel']}" if model and model.get("kernel") else model and model["dtype"]
        state = (f"{model['model_name']} ({engine}, {model['device']}, context {model['max_context']}), "
                 f"{active[role]}/{model['max_sessions']} sessions" if model else "unreachable")
        print(f"  {role:<7} {info['addresses'][role]:<22} {state}")
        if model and model.get("exactness"):  # empty from a server older than the field
            print(f"          exactness: {model['exactness']}")
        if model and model.get("security"):
            print(f"          security: {model['security']}")
        if model and model.get("prefill"):  # the weight-only engines' prefill path
            print(f"          prefill: {model['prefill']}")
        if model and model.get("forward"):  # what runs its forwards (lean decoder, its loop in C++ or Python)
            print(f"          forward: {model['forward']}")
    limits = info["limits"]
    print(f"  requests: {active['orchestrator']}/{limits['max_sessions']} active, max_new_tokens <= "
          f"{limits['max_new_tokens']}, max_lookahead <= {limits['max_lookahead']}")
    print("  policies: " + ", ".join(policy["syntax"] for policy in info["policies"]))
    for error in info["errors"]:
        print(f"  warning: {error}", file=sys.stderr)
    return 0
