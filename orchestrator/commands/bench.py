"""``disco bench``: live wall-clock benchmark of stop policies on real prompts."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from disco.errors import InvalidRequest
from orchestrator.commands.common import add_model_args, pair_config_from_args

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark policies side by side (interleaved per prompt), in process and/or over gRPC")
    parser.add_argument("--dataset", required=True, help="humaneval[:train|validation|test] or a JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-lookahead", type=int, default=20)
    parser.add_argument("--policies", required=True,
                        help="comma-separated policy specs; 'none' (the baseline) is always added")
    parser.add_argument("--transport", choices=["local", "grpc", "both"], default="local")
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="grpc transport: use this orchestrator instead of starting the services here")
    parser.add_argument("--peer", choices=["hf"], default=None,
                        help="add the row hf-assisted: HF transformers assisted generation, default settings")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--oracle-speedup", type=float, default=None,
                        help="draw this (e.g. replayed) oracle speedup as a line in speedup.png")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--report-dir", type=Path, default=None, help="bench.md, bench.csv, bench.json and PNG plots")
    add_model_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from disco.config import SamplingParams, SpeculationConfig  # noqa: PLC0415 - heavy imports when used
    from disco.datasets import load_dataset  # noqa: PLC0415
    from disco.models import disco_home  # noqa: PLC0415
    from disco.policies import parse_policy_spec  # noqa: PLC0415
    from orchestrator.bench import report, runner, transports  # noqa: PLC0415

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for policy in policies:
        parse_policy_spec(policy)
    if args.repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1, got {args.repeats}")
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    sampling.validate()
    SpeculationConfig(max_lookahead=args.max_lookahead).validate()
    dataset = load_dataset(args.dataset, args.limit)
    pair = pair_config_from_args(args)
    home = disco_home()

    runners, peer, services, client = {}, None, None, None
    tokenizer = None
    try:
        if args.transport in ("local", "both") or args.peer:
            from disco.pipeline import build_local_pipeline  # noqa: PLC0415

            pipeline = build_local_pipeline(pair, home)
            tokenizer = pipeline.tokenizer
            if args.transport in ("local", "both"):
                runners["local"] = transports.LocalRunner(pipeline.generator)
            if args.peer == "hf":
                peer = transports.HfAssistedRunner(pipeline.target.model, pipeline.draft.model,
                                                   pipeline.target.eos_token_ids,
                                                   pipeline.tokenizer.pad_token_id or pipeline.target.eos_token_ids[0])
        if args.transport in ("grpc", "both"):
            from orchestrator.client import DiscoClient  # noqa: PLC0415

            address = args.server
            if address is None:
                from orchestrator.launcher import launch  # noqa: PLC0415

                services = launch(pair)
                address = services.addresses["orchestrator"]
            client = DiscoClient(address, timeout=3600)
            runners["grpc"] = transports.GrpcRunner(client)
            if tokenizer is None:
                from orchestrator.server import load_tokenizer  # noqa: PLC0415

                tokenizer = load_tokenizer(pair.target.spec, home)
        prompts = [item.encode(tokenizer) for item in dataset.items]
        config = runner.BenchConfig(policies=policies, sampling=sampling, max_lookahead=args.max_lookahead,
                                    repeats=args.repeats, warmup=not args.no_warmup)
        result = runner.run_matrix(config, prompts, runners, peer)
    finally:
        if client is not None:
            client.close()
        if services is not None:
            services.stop()

    rows = runner.summarize(result)
    oracle_speedup = args.oracle_speedup or next(
        (r["speedup"] for r in rows if r["policy"] == "oracle"), None)
    env = report.environment({
        # `disco ...` however it was started (the script or `python -m orchestrator.cli`)
        "command": " ".join(["disco", *(shlex.quote(a) for a in sys.argv[1:])]),
        "dataset": dataset.name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype, "device": args.device, "target": pair.target.spec or "default",
        "draft": pair.draft.spec or "default", "interrupted": result.interrupted})
    print(report.markdown_table(rows))
    report.write_reports(rows, env, args.json_out, args.report_dir, plots={
        "traces": runner.lookahead_traces(result), "histograms": runner.lookahead_histograms(result),
        "oracle_speedup": oracle_speedup})
    if result.interrupted:
        print("interrupted: the table covers the prompts completed by every row", file=sys.stderr)
        return 130
    return 0
