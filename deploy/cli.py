"""The ``disco`` command line: every subcommand, those of :mod:`orchestrator.commands`
and the Ray ones of :mod:`deploy.ray_cmds`.

It sits in the top layer because it gathers commands from every layer below; the parser
and the error handling are :mod:`orchestrator.cli`'s (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import sys

from orchestrator import cli  # tunes the CPU math env on import, before anything imports torch

# Subcommand modules, in the order ``disco --help`` lists them.
COMMAND_MODULES = (*cli.COMMAND_MODULES, "deploy.ray_cmds")


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(COMMAND_MODULES)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMAND_MODULES)


if __name__ == "__main__":
    sys.exit(main())
