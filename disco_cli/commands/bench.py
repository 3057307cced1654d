"""``disco bench``: live wall-clock benchmark of stop policies on real prompts."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from disco.errors import InvalidRequest
from disco_cli.commands.common import add_model_args, pair_config_from_args

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
    parser.add_argument("--overlap", default="off", choices=["off", "on", "off,on"],
                        help="the draft engine pre-drafts the next block during verification (docs/overlap.md); "
                             "off,on: both side by side in one run (local: transport rows local and "
                             "local+overlap; grpc: one set of services per mode, rows grpc and grpc+overlap)")
    parser.add_argument("--pin-services", action="store_true",
                        help="grpc: run the target and the draft service on disjoint halves of the CPUs (threads "
                             "to match): two devices on one machine (docs/overlap.md)")
    parser.add_argument("--added-rtt-ms", type=float, default=0.0,
                        help="grpc: add this round trip to every call between the orchestrator and the services")
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="grpc transport: use this orchestrator instead of starting the services here")
    parser.add_argument("--peer", choices=["hf", "llamacpp"], default=None,
                        help="hf: add the row hf-assisted (HF transformers assisted generation, default settings); "
                             "llamacpp: add llama.cpp rows on the same .gguf files, target-only and speculative "
                             "(its defaults plus a draft sweep); needs pip install -e '.[peers]' (docs/peers.md)")
    parser.add_argument("--llamacpp-bin", type=Path, default=None, metavar="DIR",
                        help="--peer llamacpp: folder holding llama-completion and llama-speculative-simple "
                             "(default: the [peers] extra's, $DISCO_HOME/peers/llama.cpp/bin, then PATH)")
    parser.add_argument("--llamacpp-n-max", default="2,4,8", metavar="N,...",
                        help="--peer llamacpp: --spec-draft-n-max values to sweep ('' for its defaults only)")
    parser.add_argument("--llamacpp-p-min", default="0,0.75", metavar="P,...",
                        help="--peer llamacpp: --spec-draft-p-min values to sweep ('' for its defaults only)")
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
    from disco.models.loading import disco_home  # noqa: PLC0415
    from disco.offline.datasets import load_dataset  # noqa: PLC0415
    from disco.speculation.policies import parse_policy_spec, reads_costs  # noqa: PLC0415
    from disco_cli.bench import report, runner, transports  # noqa: PLC0415

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    for policy in policies:
        parse_policy_spec(policy)
    if args.repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1, got {args.repeats}")
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    sampling.validate()
    SpeculationConfig(max_lookahead=args.max_lookahead).validate()
    dataset = load_dataset(args.dataset, args.limit)
    if args.peer == "llamacpp":  # checked before --dtype auto may time the engines
        _numbers(args.llamacpp_n_max, int, "--llamacpp-n-max", 1, 64)
        _numbers(args.llamacpp_p_min, float, "--llamacpp-p-min", 0.0, 1.0)
    pair = pair_config_from_args(args)
    home = disco_home()
    llamacpp_settings = _llamacpp_settings(args, pair, home) if args.peer == "llamacpp" else None

    runners, peer, services, clients = {}, None, [], []
    tokenizer, loaded, costs = None, None, None
    engine = pair.target.dtype  # --dtype auto resolved; a remote --server reports its own below
    draft_engine = pair.draft.dtype
    kernels = {}  # role -> the int4 engine's kernel ("" for the other engines)
    try:
        if args.transport in ("local", "both") or args.peer == "hf":
            from disco.engines.in_process import build_local_pipeline  # noqa: PLC0415

            pipeline = build_local_pipeline(pair, home, measure_costs=any(map(reads_costs, policies)))
            tokenizer = pipeline.tokenizer
            loaded = {"target": pipeline.target, "draft": pipeline.draft}
            kernels = {role: model.kernel for role, model in loaded.items()}
            if args.transport in ("local", "both"):
                from disco.engines.in_process import with_overlap  # noqa: PLC0415

                for mode in args.overlap.split(","):
                    name = "local" if mode == "off" else f"local{runner.OVERLAP_SUFFIX}"
                    runners[name] = transports.LocalRunner(with_overlap(pipeline, mode == "on"))
            if args.peer == "hf":
                peer = transports.HfAssistedRunner(pipeline.target.model, pipeline.draft.model,
                                                   pipeline.target.eos_token_ids,
                                                   pipeline.tokenizer.pad_token_id or pipeline.target.eos_token_ids[0])
        if args.transport in ("grpc", "both"):
            from orchestrator.client import DiscoClient  # noqa: PLC0415

            if args.server is None:  # one set of services per --overlap mode, side by side
                from disco_cli.launcher import launch  # noqa: PLC0415

                for mode in args.overlap.split(","):
                    started = launch(pair, overlap=mode == "on", pin_cores=args.pin_services,
                                     added_rtt_ms=args.added_rtt_ms)
                    services.append(started)
                    client = DiscoClient(started.addresses["orchestrator"], timeout=3600)
                    clients.append(client)
                    name = "grpc" if mode == "off" else f"grpc{runner.OVERLAP_SUFFIX}"
                    runners[name] = transports.GrpcRunner(client)
            else:
                client = DiscoClient(args.server, timeout=3600)
                clients.append(client)
                runners["grpc"] = transports.GrpcRunner(client)
            if args.server:
                models = client.info()["models"]
                engine = (models.get("target") or {}).get("dtype") or "unknown"
                draft_engine = (models.get("draft") or {}).get("dtype") or "unknown"
                kernels = {role: (models.get(role) or {}).get("kernel", "") for role in ("target", "draft")}
            if tokenizer is None:
                from orchestrator.server import load_tokenizer  # noqa: PLC0415

                tokenizer = load_tokenizer(pair.target.spec, home)
        if loaded is not None or not args.server:  # measured (once, cached) before the benchmark
            costs = report.engine_costs(pair, home, loaded)
        prompts = [item.encode(tokenizer) for item in dataset.items]
        config = runner.BenchConfig(policies=policies, sampling=sampling, max_lookahead=args.max_lookahead,
                                    repeats=args.repeats, warmup=not args.no_warmup)
        result = runner.run_matrix(config, prompts, runners, peer)
    finally:
        for client in clients:
            client.close()
        for started in services:
            started.stop()

    rows = runner.summarize(result)
    if args.peer == "hf":
        _say_hf_baseline(rows)
    llamacpp_env = None
    if llamacpp_settings is not None and not result.interrupted:
        llamacpp_rows, llamacpp_env = _run_llamacpp(llamacpp_settings, dataset, tokenizer, prompts, args.repeats,
                                                     runner.target_only_texts(result, tokenizer, len(prompts)))
        rows += llamacpp_rows
    oracle_speedup = args.oracle_speedup or next(
        (r["speedup"] for r in rows if r["policy"] == "oracle"), None)
    env = report.environment({
        # `disco ...` however it was started (the script or `python -m disco_cli.main`)
        "command": " ".join(["disco", *(shlex.quote(a) for a in sys.argv[1:])]),
        "dataset": dataset.name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "dtype": engine, "engine": engine, "draft_engine": draft_engine, "dtype_requested": args.dtype,
        "kernel": kernels.get("target", ""), "draft_kernel": kernels.get("draft", ""),
        "overlap": args.overlap, "pin_services": args.pin_services, "added_rtt_ms": args.added_rtt_ms, "engine_costs": costs,
        "device": args.device, "target": pair.target.spec or "default",
        "draft": pair.draft.spec or "default", "interrupted": result.interrupted, "llamacpp": llamacpp_env})
    print(report.markdown_table(rows))
    report.write_reports(rows, env, args.json_out, args.report_dir, plots={
        "traces": runner.lookahead_traces(result), "histograms": runner.lookahead_histograms(result),
        "oracle_speedup": oracle_speedup})
    if result.interrupted:
        print("interrupted: the table covers the prompts completed by every row", file=sys.stderr)
        return 130
    return 0


def _say_hf_baseline(rows: list[dict]) -> None:
    """The hf-assisted row runs in this process; say which of our rows it is compared with,
    and never let an asked-for row vanish without a word."""
    from disco_cli.bench.runner import HF_PEER  # noqa: PLC0415

    row = next((r for r in rows if r["policy"] == HF_PEER), None)
    if row is None:
        print(f"--peer hf: no {HF_PEER} row (no prompt completed both it and our none row)", file=sys.stderr)
    elif row["baseline_transport"] != "local":
        print(f"--peer hf: {HF_PEER} runs in process; its speedup is against our none over "
              f"{row['baseline_transport']} (add --transport both for an in-process none)", file=sys.stderr)


def _llamacpp_settings(args: argparse.Namespace, pair, home: Path):
    """The llama.cpp peer's settings, or ``None`` (with a message) when it cannot run here:
    the rest of the benchmark runs regardless."""
    import torch  # noqa: PLC0415

    from disco_cli.bench import llamacpp  # noqa: PLC0415

    sweep_n_max = _numbers(args.llamacpp_n_max, int, "--llamacpp-n-max", 1, 64)
    sweep_p_min = _numbers(args.llamacpp_p_min, float, "--llamacpp-p-min", 0.0, 1.0)
    try:
        binaries = llamacpp.find_binaries(args.llamacpp_bin, home)
        target_gguf, draft_gguf = llamacpp.find_ggufs(pair, home)
    except llamacpp.LlamaCppError as error:
        print(f"--peer llamacpp skipped (the rest of the benchmark runs): {error}", file=sys.stderr)
        return None
    return llamacpp.LlamaCppSettings(
        *binaries, target_gguf, draft_gguf, max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads(),
        sweep_n_max=sweep_n_max, sweep_p_min=sweep_p_min, warmup=not args.no_warmup)


def _numbers(text: str, kind, flag: str, low: float, high: float) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise InvalidRequest(f"{flag}: expected comma-separated numbers, got {text!r}") from error
    if any(not low <= v <= high for v in values):
        raise InvalidRequest(f"{flag}: values must lie in [{low:g}, {high:g}], got {text!r}")
    return values


def _run_llamacpp(settings, dataset, tokenizer, prompts: list[list[int]], repeats: int,
                  ours: list[str | None]) -> tuple[list[dict], dict]:
    """llama.cpp's rows and what the JSON records about the run (or an error, printed)."""
    from disco_cli.bench import llamacpp  # noqa: PLC0415

    # raw text, tokenized by llama.cpp itself (a chat: rendered with the tokenizer's template, turn opened)
    texts = [(item.prompt or "") if item.messages is None else tokenizer.apply_chat_template(
        list(item.messages), add_generation_prompt=True, tokenize=False) for item in dataset.items]
    env = llamacpp.describe(settings, prompts)
    try:
        rows = llamacpp.summarize(llamacpp.run_peer(settings, texts, repeats), ours)
    except KeyboardInterrupt:
        print("--peer llamacpp interrupted: no llama.cpp rows", file=sys.stderr)
        return [], {**env, "error": "interrupted"}
    except llamacpp.LlamaCppError as error:
        print(f"--peer llamacpp failed (our rows are reported): {error}", file=sys.stderr)
        return [], {**env, "error": str(error)}
    return rows, env
