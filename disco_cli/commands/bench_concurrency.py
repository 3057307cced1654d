"""``disco bench-concurrency``: aggregate tokens/s at several concurrency levels through
the gRPC services — what cross-session batching buys under load — and, beside it, the
identical rate: how many requests got exactly the tokens of target-only decoding of the
same prompt run alone (batching must not change a token, in any dtype)."""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--policy", default="none")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--server", default=None, metavar="HOST:PORT", help="use a running orchestrator")
    parser.add_argument("--json-out", type=Path, default=None)
    add_model_args(parser)
    parser.set_defaults(func=run)


def _level(client, concurrency: int, policy: str, max_new_tokens: int) -> dict:
    results: list = [None] * concurrency
    errors: list[str] = []
    barrier = threading.Barrier(concurrency)

    def worker(index: int) -> None:
        barrier.wait()
        try:
            results[index] = client.generate(PROMPTS[index % len(PROMPTS)], policy=policy,
                                             max_new_tokens=max_new_tokens, ignore_eos=True)
        except Exception as error:  # noqa: BLE001 - reported in the row
            errors.append(str(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results if r is not None)
    return {"concurrency": concurrency, "tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / wall_s, 4), "errors": len(errors),
            "outputs": [list(r.token_ids) if r is not None else None for r in results]}


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
    from disco_cli.launcher import launch  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415

    levels = [int(level) for level in args.levels.split(",")]
    services = None if args.server else launch(pair_config_from_args(args))
    address = args.server or services.addresses["orchestrator"]
    rows = []
    try:
        with DiscoClient(address, timeout=3600) as client:
            _level(client, 1, args.policy, 2)  # warm-up
            print("reference: every prompt alone, target-only and with the policy ...", file=sys.stderr, flush=True)
            target_only = _alone(client, "none", args.max_new_tokens)
            alone = target_only if args.policy == "none" else _alone(client, args.policy, args.max_new_tokens)
            identical_alone = sum(alone[p] == target_only[p] for p in PROMPTS) / len(PROMPTS)
            for concurrency in levels:
                row = _level(client, concurrency, args.policy, args.max_new_tokens)
                row["identical"] = round(_identical(row["outputs"], target_only), 4)
                rows.append(row)
                print(f"concurrency {concurrency:>3}: {row['tokens_per_s']:.2f} tok/s "
                      f"({row['tokens']} tokens in {row['wall_s']:.1f} s, identical {row['identical']:.0%}, "
                      f"errors {row['errors']})", file=sys.stderr, flush=True)
    finally:
        if services is not None:
            services.stop()
    base = rows[0]["tokens_per_s"] if rows else 0
    print(f"identical to target-only: alone {identical_alone:.0%} of {len(PROMPTS)} prompts with {args.policy}; "
          "under load per row below")
    print("| concurrency | tokens/s | vs first level | identical | errors |\n|---|---|---|---|---|")
    for row in rows:
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 3) if base else None
        print(f"| {row['concurrency']} | {row['tokens_per_s']:.2f} | {row['speedup_vs_first']}x | "
              f"{row['identical']:.0%} | {row['errors']} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"policy": args.policy, "max_new_tokens": args.max_new_tokens,
                                             "dtype": args.dtype, "identical_alone": identical_alone,
                                             "rows": rows}, indent=2))
    return 0
