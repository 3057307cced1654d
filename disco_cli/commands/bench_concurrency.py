"""``disco bench-concurrency``: aggregate tokens/s at several concurrency levels through
the gRPC services — what cross-session batching buys under load — and, beside it, the
identical rate: how many requests got exactly the tokens of target-only decoding of the
same prompt run alone (batching must not change a token, in any dtype).

``--policies none,auto,static:4`` puts policies side by side in one run, interleaved per
level (level 1: every policy, then level 4: every policy, ...), so that a machine's drift
hits them alike; each row carries its policy and level, the aggregate tokens/s, the
per-request latency (p50, p95) and the ratio to ``none`` at the same level when ``none``
is among the policies.

``--rounds 2`` runs every level twice, the policies in order and then in reverse (an ABBA
design): whichever policy runs first at a level gets the machine as the previous level left
it, and on the project's 2-vCPU machines that order alone moved a policy's ratio to ``none``
by ~3% (docs/engines.md, "A margin under load"). A row is then the policy's rounds together:
all their tokens over all their wall time, latencies and identical rate over all requests,
and each round's tokens/s in ``rounds_tokens_per_s``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from disco_cli.commands.common import add_model_args, pair_config_from_args

PROMPTS = ("def fib(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):", "def quicksort(items):", "# parse a CSV file\nimport csv\n",
           "def binary_search(values, target):", "async def fetch(session, url):")


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench-concurrency",
                                   help="aggregate tokens/s at concurrency 1, 2, 4, 8, 16 over gRPC")
    parser.add_argument("--levels", default="1,2,4,8,16", help="comma-separated concurrency levels")
    parser.add_argument("--policies", "--policy", dest="policies", default="none",
                        help="comma-separated stop policies, side by side in one run (default none)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs per level, the policies' order reversed every other round (default 1)")
    parser.add_argument("--server", default=None, metavar="HOST:PORT", help="use a running orchestrator")
    parser.add_argument("--json-out", type=Path, default=None)
    add_model_args(parser)
    parser.set_defaults(func=run)


def _level(client, concurrency: int, policy: str, max_new_tokens: int) -> dict:
    results: list = [None] * concurrency
    latencies: list[float] = [0.0] * concurrency
    errors: list[str] = []
    barrier = threading.Barrier(concurrency)

    def worker(index: int) -> None:
        barrier.wait()
        started = time.perf_counter()
        try:
            results[index] = client.generate(PROMPTS[index % len(PROMPTS)], policy=policy,
                                             max_new_tokens=max_new_tokens, ignore_eos=True)
        except Exception as error:  # noqa: BLE001 - reported in the row
            errors.append(str(error))
        latencies[index] = time.perf_counter() - started

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results if r is not None)
    return {"policy": policy, "concurrency": concurrency, "tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / wall_s, 4), "latency_p50_s": round(_percentile(latencies, 50), 4),
            "latency_p95_s": round(_percentile(latencies, 95), 4), "errors": len(errors),
            "outputs": [list(r.token_ids) if r is not None else None for r in results], "latencies": latencies}


def _merge_rounds(rounds: list[dict]) -> dict:
    """One row of a policy at a level from its rounds (module docstring)."""
    if len(rounds) == 1:
        row = dict(rounds[0])
        row.pop("latencies")
        return row
    latencies = [value for row in rounds for value in row["latencies"]]
    # each round's wall from its tokens/s: ``wall_s`` is rounded to ms, too coarse for short rounds
    tokens, wall_s = sum(row["tokens"] for row in rounds), sum(
        row["tokens"] / row["tokens_per_s"] if row["tokens_per_s"] else row["wall_s"] for row in rounds)
    return {"policy": rounds[0]["policy"], "concurrency": rounds[0]["concurrency"], "tokens": tokens,
            "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 4),
            "latency_p50_s": round(_percentile(latencies, 50), 4), "latency_p95_s": round(_percentile(latencies, 95), 4),
            "errors": sum(row["errors"] for row in rounds), "outputs": [o for row in rounds for o in row["outputs"]],
            "identical": round(sum(row["identical"] for row in rounds) / len(rounds), 4),  # rounds of equal size
            "rounds_tokens_per_s": [row["tokens_per_s"] for row in rounds]}


def _percentile(values: list[float], percent: float) -> float:
    """The ``percent``-th percentile (linear interpolation; one value: that value)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(percent) - 1]


def _alone(client, policy: str, max_new_tokens: int) -> dict[str, tuple[int, ...]]:
    """Every prompt run by itself, one after another."""
    return {prompt: tuple(client.generate(prompt, policy=policy, max_new_tokens=max_new_tokens,
                                          ignore_eos=True).token_ids) for prompt in PROMPTS}


def _identical(outputs: list, expected: dict[str, tuple[int, ...]]) -> float:
    """Fraction of requests whose tokens equal ``expected`` for their prompt."""
    hits = [output is not None and tuple(output) == expected[PROMPTS[index % len(PROMPTS)]]
            for index, output in enumerate(outputs)]
    return sum(hits) / max(1, len(hits))


def run(args: argparse.Namespace) -> int:
    from disco.speculation.policies import parse_policy_spec  # noqa: PLC0415
    from disco_cli.launcher import launch  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415

    levels = [int(level) for level in args.levels.split(",")]
    policies = [policy.strip() for policy in args.policies.split(",") if policy.strip()]
    for policy in policies:
        parse_policy_spec(policy)  # a bad spec fails here, before the services start
    services = None if args.server else launch(pair_config_from_args(args))
    address = args.server or services.addresses["orchestrator"]
    rows = []
    try:
        with DiscoClient(address, timeout=3600) as client:
            for policy in policies:
                _level(client, 1, policy, 2)  # warm-up
            print("reference: every prompt alone, target-only and with each policy ...", file=sys.stderr, flush=True)
            target_only = _alone(client, "none", args.max_new_tokens)
            identical_alone = {}
            for policy in policies:
                alone = target_only if policy == "none" else _alone(client, policy, args.max_new_tokens)
                identical_alone[policy] = sum(alone[p] == target_only[p] for p in PROMPTS) / len(PROMPTS)
            for concurrency in levels:
                by_policy: dict[str, list[dict]] = {policy: [] for policy in policies}
                for round_index in range(max(1, args.rounds)):
                    for policy in policies if round_index % 2 == 0 else policies[::-1]:
                        row = _level(client, concurrency, policy, args.max_new_tokens)
                        row["identical"] = round(_identical(row["outputs"], target_only), 4)
                        by_policy[policy].append(row)
                        print(f"concurrency {concurrency:>3} {policy}: {row['tokens_per_s']:.2f} tok/s "
                              f"({row['tokens']} tokens in {row['wall_s']:.1f} s, p50 {row['latency_p50_s']:.2f} s, "
                              f"errors {row['errors']})", file=sys.stderr, flush=True)
                rows.extend(_merge_rounds(by_policy[policy]) for policy in policies)
    finally:
        if services is not None:
            services.stop()
    _print_table(rows, policies, identical_alone)
    if args.json_out:
        payload = {"policies": policies, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                   "rounds": max(1, args.rounds),
                   "identical_alone": identical_alone, "rows": rows}
        if len(policies) == 1:  # the single-policy layout of earlier result files
            payload.update(policy=policies[0], identical_alone=identical_alone[policies[0]])
        args.json_out.write_text(json.dumps(payload, indent=2))
    return 0


def _print_table(rows: list[dict], policies: list[str], identical_alone: dict[str, float]) -> None:
    """The rows as a Markdown table, with each row's ratio to its policy's first level and
    to ``none`` at the same level (when ``none`` ran)."""
    first = {}
    none_at = {row["concurrency"]: row["tokens_per_s"] for row in rows if row["policy"] == "none"}
    for row in rows:
        base = first.setdefault(row["policy"], row["tokens_per_s"])
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 3) if base else None
        none = none_at.get(row["concurrency"])
        row["vs_none"] = round(row["tokens_per_s"] / none, 3) if none else None
    print("identical to target-only, each prompt alone: "
          + ", ".join(f"{policy} {share:.0%}" for policy, share in identical_alone.items())
          + f" of {len(PROMPTS)} prompts; under load per row below")
    print("| policy | concurrency | tokens/s | vs first level | vs none | p50 s | p95 s | identical | errors |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        vs_none = f"{row['vs_none']}x" if row["vs_none"] is not None else "–"
        print(f"| {row['policy']} | {row['concurrency']} | {row['tokens_per_s']:.2f} | {row['speedup_vs_first']}x | "
              f"{vs_none} | {row['latency_p50_s']:.2f} | {row['latency_p95_s']:.2f} | {row['identical']:.0%} | "
              f"{row['errors']} |")
