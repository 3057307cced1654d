"""``disco bench-transport``: what the gRPC transport costs.

Runs the same prompts in process and through the three services on loopback (each in
its own process, as ``disco serve`` starts them), interleaved so that both paths see
the same machine load, and reports the per-iteration overhead in ms
``(remote wall - in-process wall) / iterations`` and the remote/in-process tokens/s
ratio. Wall times are measured by the caller and include tokenization on both paths.

The wall-clock difference is noisy when one iteration costs seconds (the default pair
on a CPU), so each run also reports the **transport time** per iteration from the
request's own stats: the time the loop spent in Draft and Verify calls minus the time
the draft and target services reported for them (``draft_s + verify_s -
backend_draft_s - backend_verify_s``). In process the same difference is the loop's
own bookkeeping around the engines (≈ 0).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from disco_cli.commands.common import add_model_args, dtype_from_args, pair_config_from_args

PROMPTS = (
    "def fib(n):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"",
    "# Read a CSV file and print the sum of the second column\nimport csv\n",
    "def is_prime(n: int) -> bool:",
    "async def fetch(session, url):",
    "def binary_search(values, target):",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench-transport", help="compare in-process and gRPC speculative decoding speed")
    add_model_args(parser)
    parser.add_argument("--limit", type=int, default=4, help=f"number of prompts (at most {len(PROMPTS)}, default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per prompt and path (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per run (default 64)")
    parser.add_argument("--policy", default="static:6", help="stop policy spec (default static:6)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads here and in each model process (default: torch's choice; "
                             "1 gives stable numbers on a busy machine)")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument("--floor", action="store_true",
                        help="measure only what bare grpcio costs here (no models; the lower bound of the "
                             "transport time per iteration, see disco_cli/bench/grpc_floor.py)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.floor:
        return _run_floor(args)
    import torch  # noqa: PLC0415

    from disco.config import SamplingParams, SpeculationConfig  # noqa: PLC0415 - heavy imports when used
    from disco.engines.in_process import build_local_pipeline, encode_prompt  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415
    from disco.stats import RequestStats  # noqa: PLC0415
    from disco_cli.launcher import launch  # noqa: PLC0415
    from orchestrator.client import DiscoClient  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = pair_config_from_args(args)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    speculation = SpeculationConfig(policy=args.policy)
    pipeline = build_local_pipeline(pair, disco_home())
    services = launch(pair, threads=args.threads)
    rows = []
    try:
        client = DiscoClient(services.addresses["orchestrator"], timeout=3600)

        def local(prompt: str, max_new_tokens: int = args.max_new_tokens) -> tuple[list[int], int, float, float]:
            started = time.perf_counter()
            prompt_ids = encode_prompt(pipeline.tokenizer, prompt, False)
            result = pipeline.generator.generate(prompt_ids, replace(sampling, max_new_tokens=max_new_tokens),
                                                 speculation)
            return (result.token_ids, result.stats.iterations, time.perf_counter() - started, result.stats)

        def remote(prompt: str, max_new_tokens: int = args.max_new_tokens) -> tuple[list[int], int, float, float]:
            started = time.perf_counter()
            result = client.generate(prompt, policy=args.policy, max_new_tokens=max_new_tokens, ignore_eos=True)
            wall_s = time.perf_counter() - started
            return result.token_ids, result.stats["iterations"], wall_s, RequestStats.from_dict(result.stats)

        local(PROMPTS[0], 8), remote(PROMPTS[0], 8)  # warm-up: the first calls pay one-off costs
        for index, prompt in enumerate(PROMPTS[:args.limit]):
            for repeat in range(args.repeats):
                order = (local, remote) if (index + repeat) % 2 == 0 else (remote, local)
                measured = {path.__name__: path(prompt) for path in order}
                rows.append(_row(index, repeat, measured["local"], measured["remote"]))
                if not args.json:
                    _print_row(rows[-1], header=len(rows) == 1)
        client.close()
    finally:
        services.stop()
    summary = _summary(rows, args, pipeline.target.name, pipeline.draft.name if pipeline.draft else None)
    if not args.json:
        print(f"\nper-iteration overhead {summary['overhead_ms_per_iteration']:.3f} ms (wall clock), transport "
              f"{summary['transport_ms_per_iteration']:.3f} ms (calls - server timings; in process "
              f"{summary['in_process_bookkeeping_ms_per_iteration']:.3f} ms), engine time services/in-process "
              f"{summary['engine_time_ratio']:.3f}, remote/in-process tokens/s "
              f"{summary['tokens_per_s_ratio']:.3f}, identical tokens {summary['identical_rate']:.0%}")
    print(json.dumps(summary))
    return 0


def _run_floor(args: argparse.Namespace) -> int:
    from disco_cli.bench import grpc_floor  # noqa: PLC0415

    kind, _, lookahead = args.policy.partition(":")
    block = int(lookahead) if kind == "static" and lookahead.isdigit() else 6  # a Draft block's tokens
    result = grpc_floor.measure(block_tokens=block)
    if not args.json:
        grpc_floor.print_table(result)
    print(json.dumps(result))
    return 0


def _row(prompt: int, repeat: int, local: tuple, remote: tuple) -> dict:
    (local_ids, iterations, local_s, local_stats), (remote_ids, remote_iterations, remote_s, remote_stats) = local, remote
    return {"prompt": prompt, "repeat": repeat, "tokens": len(local_ids), "iterations": iterations,
            "remote_iterations": remote_iterations, "local_s": local_s, "remote_s": remote_s,
            "overhead_ms_per_iteration": 1e3 * (remote_s - local_s) / max(iterations, 1),
            "local_transport_s": local_stats.transport_s, "remote_transport_s": remote_stats.transport_s,
            "transport_ms_per_iteration": 1e3 * remote_stats.transport_s / max(remote_iterations, 1),
            # the engines' own time (drafting + verification) on each path: tells the
            # transport apart from the models computing slower in their own processes
            "local_engine_s": local_stats.backend_draft_s + local_stats.backend_verify_s,
            "remote_engine_s": remote_stats.backend_draft_s + remote_stats.backend_verify_s,
            "identical": local_ids == remote_ids}


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'prompt':>6} {'rep':>3} {'tokens':>6} {'iters':>5} {'in-proc ms':>10} {'remote ms':>10} "
              f"{'ms/iter':>8} {'transport ms/iter':>17} {'same':>5}")
    print(f"{row['prompt']:>6} {row['repeat']:>3} {row['tokens']:>6} {row['iterations']:>5} "
          f"{1e3 * row['local_s']:>10.1f} {1e3 * row['remote_s']:>10.1f} {row['overhead_ms_per_iteration']:>8.3f} "
          f"{row['transport_ms_per_iteration']:>17.3f} {'yes' if row['identical'] else 'NO':>5}")


def _summary(rows: list[dict], args: argparse.Namespace, target: str, draft: str | None) -> dict:
    tokens = sum(row["tokens"] for row in rows)
    local_s, remote_s = sum(row["local_s"] for row in rows), sum(row["remote_s"] for row in rows)
    iterations = sum(row["iterations"] for row in rows)
    return {
        "target": target, "draft": draft, "dtype": dtype_from_args(args), "device": args.device, "threads": args.threads,
        "policy": args.policy,
        "max_new_tokens": args.max_new_tokens, "runs": len(rows), "iterations": iterations,
        "local_tokens_per_s": tokens / local_s, "remote_tokens_per_s": tokens / remote_s,
        "tokens_per_s_ratio": local_s / remote_s,
        "overhead_ms_per_iteration": 1e3 * (remote_s - local_s) / max(iterations, 1),
        "transport_ms_per_iteration": 1e3 * sum(row["remote_transport_s"] for row in rows) / max(
            sum(row["remote_iterations"] for row in rows), 1),
        "in_process_bookkeeping_ms_per_iteration": 1e3 * sum(row["local_transport_s"] for row in rows) / max(
            iterations, 1),
        "engine_time_ratio": sum(row["remote_engine_s"] for row in rows) / max(
            sum(row["local_engine_s"] for row in rows), 1e-9),
        "identical_rate": sum(row["identical"] for row in rows) / max(len(rows), 1),
    }
