"""``disco demo``: the README's main job in the real shape — start the target, draft and
orchestrator services locally (the default pair unless models are given), stream one
completion through the public gRPC API with its stats, compare it with target-only
decoding through the same services, and stop everything."""

from __future__ import annotations

import argparse
import sys

from disco.stats import RequestStats
from disco_cli.commands.common import add_model_args, pair_config_from_args
from disco_cli.commands.serve import add_overlap_arg, overlap_from_args

DEMO_PROMPT = "def fib(n):"
#: Tokens of the untimed warm-up request per policy.
WARMUP_TOKENS = 8


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="start the three services, stream a completion through them, stop")
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--baseline", default="none",
                        help="also run this policy through the services and compare tokens and speed "
                             "('skip' to skip; default none = target-only)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_overlap_arg(parser)
    add_model_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from disco.speculation.policies import parse_policy_spec  # noqa: PLC0415
    from disco_cli.launcher import launch  # noqa: PLC0415
    from orchestrator.client import DiscoClient, DiscoRpcError  # noqa: PLC0415

    parse_policy_spec(args.policy)
    pair = pair_config_from_args(args)
    print("starting the target, draft and orchestrator services (the first run prepares the default pair)...",
          file=sys.stderr)
    services = launch(pair, overlap=overlap_from_args(args))
    try:
        address = services.addresses["orchestrator"]
        print(f"orchestrator listening on {address} (draft {services.addresses['draft']}, "
              f"target {services.addresses['target']})", file=sys.stderr)
        with DiscoClient(address, timeout=3600) as client:
            request = dict(max_new_tokens=args.max_new_tokens)
            # The first forwards of a fresh process are slow (kernel set-up, caches): one
            # short request per policy first, so the timed runs compare steady states.
            kernel = (client.info()["models"].get("target") or {}).get("kernel")
            engine = f"{pair.engine}, {kernel}" if kernel else pair.engine  # e.g. "int4, q4q8-vnni"
            print("warming up the services (one short request per policy)...", file=sys.stderr)
            for policy in (args.policy, args.baseline):
                if policy != "skip":
                    client.generate(args.prompt, policy=policy, max_new_tokens=WARMUP_TOKENS)
            print(f"\n--- {args.policy}: {args.prompt!r}", file=sys.stderr)
            sys.stdout.write(args.prompt)
            stream = client.stream(args.prompt, policy=args.policy, **request)
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            print()
            result = stream.result
            stats = RequestStats.from_dict(result.stats)
            print(f"[{args.policy} | {engine}] {stats.summary_line()}", file=sys.stderr)
            if args.baseline != "skip":
                print(f"--- {args.baseline} (baseline, same services) ...", file=sys.stderr)
                baseline = client.generate(args.prompt, policy=args.baseline, **request)
                base_stats = RequestStats.from_dict(baseline.stats)
                print(f"[{args.baseline} | {engine}] {base_stats.summary_line()}", file=sys.stderr)
                print(comparison_line(args.policy, args.baseline, stats, base_stats,
                                      baseline.token_ids == result.token_ids, costs_text(client.info()["models"])),
                      file=sys.stderr)
    except DiscoRpcError as error:
        print(f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        services.stop()
    return 0


def comparison_line(policy: str, baseline: str, stats: RequestStats, base_stats: RequestStats, same: bool,
                    costs: str) -> str:
    """The demo's last line: identical or not, and the speedup, except where the policy drafted
    nothing (``auto`` where the costs say speculation cannot pay): then both runs were
    target-only, and their ratio is noise, not a speedup; the line says so, and why."""
    identical = f"tokens identical to {baseline}: {'yes' if same else 'NO'}"
    rates = f"{stats.tokens_per_s:.2f} vs {base_stats.tokens_per_s:.2f} tok/s"
    if stats.draft_forwards == 0 and policy != baseline:
        return (f"{identical}; {policy} drafted nothing: it ran target-only, as {baseline} did ({costs}), so there "
                f"is no speedup to report ({rates} is the spread between two target-only runs)")
    speedup = stats.tokens_per_s / base_stats.tokens_per_s if base_stats.tokens_per_s else 0.0
    return f"{identical}; speedup {speedup:.2f}x ({rates})"


def costs_text(models: dict) -> str:
    """The measured engine costs the services report (``Info.forward_s``), in one phrase: what
    ``auto`` decides with (the orchestrator corrects them by the live costs under load)."""
    target = (models.get("target") or {}).get("forward_s") or []
    draft = (models.get("draft") or {}).get("forward_s") or []
    if not target or not draft:
        return "the services reported no measured costs"
    longest = min(len(target), 5)
    ratio = f", {draft[0] / target[0]:.2f} of a one-token target forward" if target[0] > 0 else ""
    return (f"the costs auto decided with: target {target[0] * 1e3:.1f} ms for 1 new token, "
            f"{target[longest - 1] * 1e3:.1f} ms for {longest}; draft {draft[0] * 1e3:.1f} ms per token{ratio}")
