"""DISCO training and analysis commands: ``disco records``, ``disco train``,
``disco replay``, ``disco tune``, ``disco report`` and ``disco cost-model``.

All of them run in process on oracle records (:mod:`disco.offline.records`), which are
computed on first use and cached under ``$DISCO_HOME/records``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from disco.errors import DiscoError
from disco_cli.commands.common import add_model_args, pair_config_from_args

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    records = subparsers.add_parser("records", help="compute (or resume) the oracle records of a dataset")
    _add_data_args(records)
    records.add_argument("--json", action="store_true", help="print one JSON summary object")
    records.set_defaults(func=run_records)

    train = subparsers.add_parser("train", help="train a DISCO stop classifier and write an artifact")
    _add_data_args(train)
    train.add_argument("--validation", default=None,
                       help="validation dataset for model choice and threshold tuning (default: "
                            "humaneval:validation for HumanEval, else the last 25%% of --dataset)")
    train.add_argument("--validation-limit", type=int, default=None, help="first N validation prompts")
    train.add_argument("--out", type=Path, required=True, help="artifact file to write (.disco)")
    train.add_argument("--models", default="logreg,mlp,gbm",
                       help="comma-separated classifiers to try: logreg, mlp, gbm (default all)")
    train.add_argument("--groups", default=None,
                       help="feature groups, comma-separated (default probs,position,block,session,draw; "
                            "add hidden for the projected hidden state)")
    train.add_argument("--hidden-dims", type=int, default=16, help="PCA dims of the hidden state (with hidden)")
    train.add_argument("--label", default="auto", choices=["auto", "current", "next", "conditional"],
                       help="what P(accept) is about: the block so far (current), the block through the next "
                            "token (next), this token given the previous ones (conditional), or pick by replay "
                            "(default)")
    train.add_argument("--rule", default="auto", choices=["auto", "token", "cumulative", "gain"],
                       help="decision rule: stop when P < t (token), when the block's product of conditional "
                            "P < t (cumulative, SpecDec++), when the expected gain of one more token under the "
                            "cost model < t x its cost (gain), or pick by replay (default)")
    train.add_argument("--select", default="cv", choices=["cv", "validation"],
                       help="choose classifier, label, rule and threshold by cross-validated replay over the train + "
                            "validation prompts (cv, default) or by replay on the validation prompts only")
    train.add_argument("--folds", type=int, default=4, help="folds of --select cv (default 4)")
    train.add_argument("--dagger-rounds", type=int, default=1,
                       help="with --select validation: rounds that add the trained policy's own replayed states and refit (default 1)")
    train.add_argument("--max-lookahead", type=int, default=None,
                       help="lookahead cap used for replay (default 20, the serving default)")
    _add_cost_args(train)
    train.add_argument("--json", action="store_true", help="print the validation table as JSON")
    train.set_defaults(func=run_train)

    replay = subparsers.add_parser("replay", help="replay stop policies on oracle records (simulated speedup)")
    _add_data_args(replay)
    replay.add_argument("--policies", required=True,
                        help="comma-separated policy specs; ranges like static:1-12 and "
                             "confidence:0.1-0.9/0.1 are expanded")
    replay.add_argument("--max-lookahead", type=int, default=None, help="lookahead cap (default 20)")
    replay.add_argument("--ignore-eos", action="store_true", help="replay past EOS up to --max-new-tokens")
    replay.add_argument("--json-out", type=Path, default=None, help="write the JSON report here")
    replay.add_argument("--overlap-rtt-ms", default=None, metavar="MS,...",
                        help="also estimate overlapped drafting (draft and target on two devices) at these "
                             "round-trip times, e.g. 0,1,5,20 (disco.offline.overlap_estimate)")
    _add_cost_args(replay)
    replay.set_defaults(func=run_replay)

    tune = subparsers.add_parser("tune", help="re-tune a DISCO artifact's threshold (of its stored rule) for "
                                              "another cost model")
    tune.add_argument("--artifact", type=Path, required=True, help="artifact to re-tune")
    tune.add_argument("--out", type=Path, required=True, help="where to write the re-tuned artifact")
    _add_data_args(tune, dataset_required=False)
    _add_cost_args(tune)
    tune.add_argument("--max-lookahead", type=int, default=None, help="lookahead cap (default: the artifact's)")
    tune.set_defaults(func=run_tune)

    report = subparsers.add_parser("report", help="paper-style replay report on a test split (+ Fig. 1 plot)")
    _add_data_args(report)
    report.add_argument("--tune-dataset", action="append", default=None,
                        help="dataset(s) the training-free baselines are tuned on (repeatable; default "
                             "humaneval:train and humaneval:validation)")
    report.add_argument("--tune-limit", type=int, action="append", default=None,
                        help="first N prompts of each --tune-dataset (repeat in the same order)")
    report.add_argument("--artifact", default="default", help="DISCO artifact: a path or 'default'")
    report.add_argument("--max-lookahead", type=int, default=None, help="lookahead cap (default 20)")
    report.add_argument("--plot", type=Path, default=None, help="write the oracle-vs-static lookahead PNG here")
    report.add_argument("--plot-prompt", type=int, default=0, help="index of the test prompt to plot")
    report.add_argument("--json-out", type=Path, default=None, help="write the JSON report here")
    _add_cost_args(report)
    report.set_defaults(func=run_report)

    cost = subparsers.add_parser("cost-model", help="measure t_draft and t_verify(k) on the live engines")
    add_model_args(cost)
    cost.add_argument("--max-k", type=int, default=12, help="largest block size to time (default 12)")
    cost.add_argument("--repeats", type=int, default=3, help="timings per point; the median is kept")
    cost.add_argument("--rtt", type=float, default=0.0, help="RPC round-trip seconds to add (default 0)")
    cost.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    cost.add_argument("--out", type=Path, required=True, help="cost model JSON to write")
    cost.set_defaults(func=run_cost_model)


def _add_data_args(parser: argparse.ArgumentParser, dataset_required: bool = True) -> None:
    parser.add_argument("--dataset", required=dataset_required,
                        help="humaneval, humaneval:train|validation|test, or a .jsonl file (prompt or messages)")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--horizon", type=int, default=6,
                        help="free-running draft steps stored after each mismatch (default 6; replay is "
                             "exact when no block runs further past its first rejection)")
    parser.add_argument("--no-hidden", action="store_true", help="do not store the draft's hidden states")
    parser.add_argument("--temperatures", default="0", metavar="T,...",
                        help="record at these sampling temperatures, comma-separated (default 0: greedy); "
                             "each T > 0 adds sampled records (drafter-invariant sampling, one seed per prompt)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p of the sampled records (default 1.0)")
    parser.add_argument("--record-seed", type=int, default=0,
                        help="base seed the sampled records' per-prompt seeds derive from (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_model_args(parser)
    # NOTE: records default to float32: replay is then exact, and on CPUs without native
    # bf16 a float32 prefill/teacher-forced pass is also about twice as fast.
    parser.set_defaults(dtype="float32")
    for action in parser._actions:
        if action.dest == "dtype":
            action.help = "dtype the records are computed in (default float32 here: exact replay)"


def _add_cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cost model")
    group.add_argument("--cost-model", default=None,
                       help="cost model JSON file (from `disco cost-model`), or 'orientation' "
                            "(t_draft 90 ms, t_verify 225 ms, rtt 15 ms); default: the artifact's, else orientation")
    group.add_argument("--rtt", type=float, default=None, help="override the cost model's round-trip seconds")


def _record_configs(args: argparse.Namespace) -> list:
    """One record config per ``--temperatures`` entry (validated before any model loads)."""
    from disco.errors import InvalidRequest  # noqa: PLC0415
    from disco.offline.records import RecordConfig  # noqa: PLC0415

    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        raise InvalidRequest(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
    if not temperatures or len(set(temperatures)) != len(temperatures):
        raise InvalidRequest(f"--temperatures needs distinct values, got {args.temperatures!r}")
    configs = [RecordConfig(max_new_tokens=args.max_new_tokens, horizon=args.horizon, with_hidden=not args.no_hidden,
                            temperature=t, top_p=args.top_p if t > 0 else 1.0, seed=args.record_seed)
               for t in temperatures]
    for config in configs:
        config.validate()
    return configs


def _records(args: argparse.Namespace, pair_records, dataset):
    """The records of ``dataset`` at every ``--temperatures`` entry, as one set."""
    from disco.offline.records import merge  # noqa: PLC0415

    return merge([pair_records.get(dataset, config) for config in _record_configs(args)])


def _pair_records(args: argparse.Namespace):
    import torch  # noqa: PLC0415

    from disco.models.loading import disco_home  # noqa: PLC0415
    from disco.offline.records import PairRecords  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    return PairRecords(pair_config_from_args(args), disco_home())


def _cost_model(args: argparse.Namespace, fallback=None):
    from disco.speculation.cost_model import CostModel  # noqa: PLC0415

    if args.cost_model:
        model = CostModel.orientation() if args.cost_model == "orientation" else CostModel.load(Path(args.cost_model))
    else:
        model = fallback or CostModel.orientation()
    if args.rtt is not None:
        model = model.with_rtt(args.rtt)
    return model


def run_records(args: argparse.Namespace) -> int:
    from disco.offline.datasets import load_dataset  # noqa: PLC0415

    dataset = load_dataset(args.dataset, args.limit)
    records = _records(args, _pair_records(args), dataset)
    tokens = sum(len(r.continuation) for r in records.records)
    accepted = sum(int(r.matches.sum()) for r in records.records)
    summary = {"dataset": dataset.name, "prompts": len(records.records), "path": str(records.path),
               "tokens": tokens, "teacher_forced_match_rate": round(accepted / max(tokens, 1), 4),
               "seconds": round(sum(r.seconds for r in records.records), 1)}
    print(json.dumps(summary) if args.json else
          "\n".join(f"{key}: {value}" for key, value in summary.items()))
    return 0


def run_train(args: argparse.Namespace) -> int:
    from disco.offline import training  # noqa: PLC0415

    return training.run_train_command(args, _pair_records(args), _record_configs(args), _cost_model(args))


def run_replay(args: argparse.Namespace) -> int:
    from disco.offline import replay  # noqa: PLC0415
    from disco.offline.datasets import load_dataset  # noqa: PLC0415

    dataset = load_dataset(args.dataset, args.limit)
    records = _records(args, _pair_records(args), dataset)
    cost = _cost_model(args)
    report = replay.replay_report(records, replay.expand_policies(args.policies), cost,
                                  max_lookahead=args.max_lookahead or replay.DEFAULT_REPLAY_LOOKAHEAD,
                                  honor_eos=not args.ignore_eos)
    print(replay.format_report(report))
    if args.overlap_rtt_ms:
        report["overlap_estimate"] = _overlap_estimate(args, records, cost)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from disco.offline import training  # noqa: PLC0415

    return training.run_tune_command(args, _pair_records(args) if args.dataset else None,
                                     _record_configs(args) if args.dataset else None, _cost_model)


def run_cost_model(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from disco.engines.engine_costs import measure_cost_model  # noqa: PLC0415
    from disco.models.loading import disco_home, load_pair  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = load_pair(pair_config_from_args(args), disco_home())
    model = measure_cost_model(target.model, draft.model, max_k=args.max_k, repeats=args.repeats, rtt=args.rtt,
                    source=f"measured: {target.name} / {draft.name}, {target.engine}, {args.device}, "
                           f"{torch.get_num_threads()} threads")
    model.save(args.out)
    print(json.dumps(model.to_json(), indent=2))
    return 0


def run_report(args: argparse.Namespace) -> int:
    from disco.offline import replay, report  # noqa: PLC0415
    from disco.offline.datasets import load_dataset  # noqa: PLC0415
    from disco.offline.records import merge  # noqa: PLC0415
    from disco.speculation.policies.learned import load_artifact  # noqa: PLC0415

    pair_records = _pair_records(args)
    test = _records(args, pair_records, load_dataset(args.dataset, args.limit))
    tune_specs = args.tune_dataset or ["humaneval:train", "humaneval:validation"]
    limits = (args.tune_limit or []) + [None] * len(tune_specs)
    tune = merge([_records(args, pair_records, load_dataset(spec, limit))
                         for spec, limit in zip(tune_specs, limits)])
    artifact = load_artifact(args.artifact) if args.artifact else None
    stored = artifact.metadata.get("cost_model") if artifact is not None else None
    from disco.speculation.cost_model import CostModel  # noqa: PLC0415

    cost = _cost_model(args, CostModel.from_json(stored) if stored else None)
    max_lookahead = args.max_lookahead or replay.DEFAULT_REPLAY_LOOKAHEAD
    result = report.paper_report(test, tune, cost, artifact, max_lookahead)
    print(replay.format_report(result))
    print(report.format_summary(result))
    if args.plot:
        best_k = int(result["summary"]["best_static_hindsight"].split(":")[1])
        result["plot"] = report.plot_oracle_lookahead(test, args.plot_prompt, best_k, args.plot, max_lookahead)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def _overlap_estimate(args: argparse.Namespace, records, cost) -> list[dict]:
    """Sequential vs overlapped tokens/s per policy and round trip (printed and returned)."""
    from disco.offline import replay  # noqa: PLC0415
    from disco.offline.overlap_estimate import estimate_policy  # noqa: PLC0415

    try:
        rtts = [float(value) for value in args.overlap_rtt_ms.split(",")]
    except ValueError:
        raise DiscoError(f"--overlap-rtt-ms takes comma-separated milliseconds, got {args.overlap_rtt_ms!r}") from None
    rows = []
    print(f"\n{'policy':<24}{'rtt ms':>8}{'seq tok/s':>11}{'overlap tok/s':>15}{'gain':>7}{'hit rate':>10}")
    for spec in replay.expand_policies(args.policies):
        if spec == "none":
            continue
        for rtt in rtts:
            result, tokens = estimate_policy(records, spec, cost.with_rtt(rtt / 1000),
                                             args.max_lookahead or replay.DEFAULT_REPLAY_LOOKAHEAD,
                                             honor_eos=not args.ignore_eos)
            row = {"policy": spec, "rtt_ms": rtt, "sequential_tokens_per_s": tokens / result.sequential_s,
                   "overlapped_tokens_per_s": tokens / result.overlapped_s, "gain": result.speedup,
                   "hit_rate": result.hit_rate, "free_tokens": result.free_tokens}
            rows.append(row)
            print(f"{spec:<24}{rtt:>8g}{row['sequential_tokens_per_s']:>11.2f}{row['overlapped_tokens_per_s']:>15.2f}"
                  f"{result.speedup:>7.2f}{result.hit_rate:>10.2f}")
    return rows
