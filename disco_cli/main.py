"""The ``disco`` command line: one parser, subcommands registered from
:mod:`disco_cli.commands` (the Ray ones included). Domain errors become one stderr line
and exit code 2.

``disco`` and ``python -m disco_cli.main`` are the same program; the local launcher
starts its child services through the latter (docs/architecture.md)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Callable

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()  # before anything imports torch

from disco.errors import DiscoError  # noqa: E402
from disco.models import hub_kernels  # noqa: E402

# Subcommand modules, in the order ``disco --help`` lists them.
COMMAND_MODULES = (
    "disco_cli.commands.demo",
    "disco_cli.commands.generate",
    "disco_cli.commands.policies",
    "disco_cli.commands.models",
    "disco_cli.commands.offline",
    "disco_cli.commands.bench",
    "disco_cli.commands.bench_concurrency",
    "disco_cli.commands.serve", "disco_cli.commands.info", "disco_cli.commands.bench_transport",
    "disco_cli.commands.http",
    "disco_cli.commands.doctor",
    "disco_cli.commands.ray",
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
    return run(build_parser(modules).parse_args(argv))


def run(args: argparse.Namespace, func: Callable[[argparse.Namespace], int] | None = None) -> int:
    """Run a parsed command (``func``, default ``args.func``) with the CLI's logging and error handling."""
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        hub_kernels.keep_off()  # before any model load: no Hub kernels, no download (disco.models.hub_kernels)
        return int((func or args.func)(args) or 0)
    except DiscoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
