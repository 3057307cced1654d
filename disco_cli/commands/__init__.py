"""Subcommands of the ``disco`` CLI, one module each; every module exposes
``register(subparsers)`` which adds its parser and sets ``func(args) -> int``."""
