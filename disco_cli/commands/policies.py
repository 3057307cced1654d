"""``disco policies``: list the stop-policy specs."""

from __future__ import annotations

import argparse
import json

from disco.speculation.policies import POLICY_INFOS


def register(subparsers) -> None:
    parser = subparsers.add_parser("policies", help="list the available stop-policy specs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = [{"name": info.name, "spec": info.syntax, "description": info.description} for info in POLICY_INFOS]
    if args.json:
        print(json.dumps({"policies": rows}))
        return 0
    width = max(len(row["spec"]) for row in rows)
    for row in rows:
        print(f"{row['spec']:<{width}}  {row['description']}")
    return 0
