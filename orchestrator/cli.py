"""The command line up to the orchestrator layer: one parser, subcommands registered from
:mod:`orchestrator.commands`. Domain errors become one stderr line and exit code 2.

The ``disco`` script is :mod:`deploy.cli`: these commands plus the Ray ones, gathered in
the top layer (docs/architecture.md). ``python -m orchestrator.cli`` runs every command
but the Ray ones; the local launcher starts its child services through it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()  # before anything imports torch

from disco.errors import DiscoError  # noqa: E402

# Subcommand modules of the layers up to this one, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "orchestrator.commands.demo",
    "orchestrator.commands.generate",
    "orchestrator.commands.policies",
    "orchestrator.commands.models",
    "orchestrator.commands.disco_cmds",
    "orchestrator.commands.bench",
    "orchestrator.commands.bench_concurrency",
    "orchestrator.commands.serve", "orchestrator.commands.info", "orchestrator.commands.bench_transport",
    "orchestrator.commands.http",
)


def build_parser(modules: tuple[str, ...] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The parser of the subcommands in ``modules``, each exposing ``register(subparsers)``."""
    parser = argparse.ArgumentParser(
        prog="disco",
        description="Speculative decoding with a learned dynamic lookahead (DISCO), as gRPC services.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of progress messages on stderr (default INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None, modules: tuple[str, ...] = COMMAND_MODULES) -> int:
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except DiscoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
