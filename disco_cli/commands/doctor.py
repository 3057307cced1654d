"""``disco doctor``: the check a user runs on a new machine.

It reports the device and the engines it supports, then, per engine, loads the pair,
measures its forward costs, and checks greedy exactness (speculative vs target-only,
alone and with concurrent sessions batched) and a seeded sampled request (alone, again
and under load). Without model arguments it checks random-weight models of the default
pair's architectures (nothing downloaded); ``--real`` uses the prepared default pair,
``--target/--draft`` any pair. ``--json`` prints one object ``{"ok", "checks": [...]}``;
the exit code is 1 when a check fails (docs/cli.md). The checks: :mod:`disco_cli.doctor_checks`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from disco.config import ENGINE_DTYPES
from disco.errors import InvalidRequest
from disco_cli.doctor_checks import CheckResult, DoctorConfig, check_engine, run_check
from disco_cli.doctor_setup import device_check, engine_support, engines_check, validate_device, write_random_pair


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check this machine: device, engines, their costs, greedy exactness, seeded sampling")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--target", default=None, help="target model (HF folder, hub id or .gguf); with --draft")
    parser.add_argument("--draft", default=None, help="draft model (HF folder, hub id or .gguf); with --target")
    parser.add_argument("--real", action="store_true",
                        help="check the prepared default pair (prepared on first use) instead of random-weight "
                             "models of its architectures")
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated engines to check (of {', '.join(ENGINE_DTYPES)}; default: every "
                             "engine the device supports)")
    parser.add_argument("--policy", default=DoctorConfig.policy,
                        help=f"speculative policy compared with target-only (default {DoctorConfig.policy})")
    parser.add_argument("--max-new-tokens", type=int, default=DoctorConfig.max_new_tokens,
                        help=f"tokens per request (default {DoctorConfig.max_new_tokens})")
    parser.add_argument("--sessions", type=int, default=DoctorConfig.sessions,
                        help=f"concurrent sessions of the batched and under-load checks (default "
                             f"{DoctorConfig.sessions})")
    parser.add_argument("--seed", type=int, default=DoctorConfig.seed,
                        help=f"seed of the sampled request (default {DoctorConfig.seed})")
    parser.add_argument("--json", action="store_true", help='print one JSON object {"ok", "checks": [...]}')
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> DoctorConfig:
    """The doctor's config; raises :class:`InvalidRequest` for flags that do not fit together."""
    from disco.speculation.policies import parse_policy_spec  # noqa: PLC0415

    validate_device(args.device)
    if (args.target is None) != (args.draft is None):
        raise InvalidRequest("--target and --draft go together (or neither: random-weight default-pair shapes)")
    if args.real and args.target is not None:
        raise InvalidRequest("--real checks the default pair; it does not go with --target/--draft")
    if args.max_new_tokens < 2:
        raise InvalidRequest(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if args.sessions < 2:
        raise InvalidRequest(f"--sessions must be >= 2 (a batch), got {args.sessions}")
    spec = parse_policy_spec(args.policy)
    if not spec.uses_draft:
        raise InvalidRequest(f"--policy must draft (it is compared with target-only), got {args.policy!r}")
    if args.engines is None:
        engines = engine_support(args.device)[0]
    else:
        engines = tuple(dict.fromkeys(e.strip() for e in args.engines.split(",") if e.strip()))
        unknown = [e for e in engines if e not in ENGINE_DTYPES]
        if unknown or not engines:
            raise InvalidRequest(f"--engines takes engines of {', '.join(ENGINE_DTYPES)}, got {args.engines!r}")
    return DoctorConfig(device=args.device, engines=engines, policy=args.policy, max_new_tokens=args.max_new_tokens,
                        sessions=args.sessions, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    started = time.perf_counter()
    checks = [device_check(config.device)]
    models = "--target/--draft" if args.target else "the prepared default pair" if args.real else \
        "random-weight models of the default pair's architectures"
    if checks[0].ok:
        checks.append(engines_check(config.device, config.engines))
        with tempfile.TemporaryDirectory(prefix="disco_doctor_") as scratch:
            folders, home = _models(args, Path(scratch), checks)
            if folders is not None:
                peaks = _peaks(home) if config.device == "cpu" else None
                for engine in config.engines:
                    checks.extend(check_engine(config, engine, folders, home, _progress, peaks))
    report = {"ok": all(check.ok for check in checks), "device": config.device, "models": models,
              "wall_s": round(time.perf_counter() - started, 1), "checks": [check.to_json() for check in checks]}
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1


def _models(args: argparse.Namespace, scratch: Path, checks: list[CheckResult]) -> tuple[dict | None, Path]:
    """The specs of the pair (``None``: the default model of the role) and the cache folder
    the engines use: for the random pair a scratch home (its quantized copies and costs are
    thrown away with it), else the user's (``DISCO_HOME``). ``None`` instead of specs when
    the pair could not be built or found (its check says why)."""
    from disco.models.loading import disco_home, resolve_location  # noqa: PLC0415

    if args.target is not None:
        return {"target": args.target, "draft": args.draft}, disco_home()
    if args.real:
        home = disco_home()
        _progress("locating the prepared default pair (prepared on first use) ...")
        result = run_check("models", None, "cpu", lambda: CheckResult(
            "", True, "the prepared default pair",
            data={role: resolve_location(None, role, home, progress=False)[0] for role in ("target", "draft")}))
        checks.append(result)
        return ({"target": None, "draft": None} if result.ok else None), home  # None: the default pair
    _progress("building random-weight models of the default pair's architectures (seeded; no download) ...")
    result = run_check("models", None, "cpu", lambda: CheckResult(
        "", True, "random weights, default-pair architectures (Qwen2.5-Coder 1.5B / 0.5B shapes)",
        data=write_random_pair(scratch / "models")))
    checks.append(result)
    return ({role: result.data[role] for role in ("target", "draft")} if result.ok else None), scratch / "home"


def _peaks(home: Path):
    """The machine's roofline peaks, measured at first use and kept for the run."""
    measured: list = []

    def peaks():
        if not measured:
            from disco.engines.roofline import measure_peaks  # noqa: PLC0415 - torch

            _progress("measuring this machine's read bandwidth and int8 peak ...")
            measured.append(measure_peaks(home))
        return measured[0]

    return peaks


def format_report(report: dict) -> str:
    """The readable table: one line per check, then the verdict."""
    lines = [f"disco doctor on {report['device']}: {report['models']}",
             f"{'check':<16}{'engine':<11}{'':<6}{'seconds':>8}  detail"]
    for check in report["checks"]:
        lines.append(f"{check['name']:<16}{check['engine'] or '-':<11}{'ok' if check['ok'] else 'FAIL':<6}"
                     f"{check['seconds']:>8.1f}  {check['detail']}")
    failed = [check for check in report["checks"] if not check["ok"]]
    lines.append(f"all {len(report['checks'])} checks passed in {report['wall_s']} s" if not failed else
                 f"FAILED: {len(failed)} of {len(report['checks'])} checks ("
                 + ", ".join(f"{c['name']}{'[' + c['engine'] + ']' if c['engine'] else ''}" for c in failed)
                 + f") in {report['wall_s']} s")
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"doctor: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)
