"""Issue 29, item 4: how well DISCO's predicted acceptance matches what the target accepts
on this deployment, before and after the online calibration
(:mod:`disco.speculation.acceptance_calibration`).

The real pair at the given engines (default: ``--dtype auto``, as served), in process,
``auto`` with the measured costs, greedy, on prompts **outside the training split**
(``--dataset``, default ``humaneval:test``), one request after another through one draft
deployment, run twice side by side:

* **calibrated** (the default): each request decides with the calibration learned from
  the requests before it;
* **raw**: the classifier's predictions as shipped (``calibrate_acceptance=False``).

Reported (``--json-out`` writes it): the expected calibration error (10 equal bins) of the
classifier's raw predictions and of the calibrated ones the requests used (prequential: a
token's calibrated probability is fixed before its outcome is known), the table of observed
acceptance by predicted probability, and each run's tokens/s, mean block and acceptance
(speed only valid on a quiet machine; output identical in both).

Usage: python docs/analysis/acceptance_calibration.py [--dataset humaneval:test] [--limit 20]
       [--max-new-tokens 64] [--dtype auto] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from disco.platform import tune_cpu_math_env

tune_cpu_math_env()

from disco.config import DTYPE_CHOICES, SamplingParams, SpeculationConfig  # noqa: E402
from disco.engines.draft import DraftEngine  # noqa: E402
from disco.engines.in_process import build_local_pipeline, default_learned_loader  # noqa: E402
from disco.models.loading import disco_home  # noqa: E402
from disco.offline.datasets import load_dataset  # noqa: E402
from disco.speculation.loop import SpeculativeGenerator  # noqa: E402
from disco.speculation.policies import PolicyFactory  # noqa: E402
from disco_cli.commands.common import pair_config_from_args  # noqa: E402


def run(generators: dict, prompts, max_new_tokens: int) -> dict:
    """Each prompt through every generator in turn (interleaved: drift hits both alike)."""
    rows = {label: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "blocks": 0, "outputs": []}
            for label in generators}
    for index, ids in enumerate(prompts, start=1):
        for label, generator in generators.items():
            result = generator.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                                        SpeculationConfig(policy="auto"))
            row, stats = rows[label], result.stats
            row["outputs"].append(result.token_ids)
            row["tokens"] += len(result.token_ids)
            row["seconds"] += stats.wall_s
            row["drafted"] += stats.draft_tokens
            row["accepted"] += stats.accepted_tokens
            row["blocks"] += len(stats.lookaheads)
            print(f"  {index}/{len(prompts)} {label}: {len(result.token_ids) / stats.wall_s:.2f} tok/s, "
                  f"mean block {stats.mean_lookahead:.2f}", file=sys.stderr, flush=True)
    return {label: {"tokens_per_s": round(row["tokens"] / row["seconds"], 3),
                    "mean_block": round(row["drafted"] / max(row["blocks"], 1), 3),
                    "acceptance": round(row["accepted"] / max(row["drafted"], 1), 3), "outputs": row["outputs"]}
            for label, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="humaneval:test")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES))
    parser.add_argument("--draft-dtype", default=None, choices=list(DTYPE_CHOICES))
    parser.add_argument("--json-out")
    args = parser.parse_args()
    args.target = args.draft = None
    args.device = "cpu"
    pair = pair_config_from_args(args)
    pipeline = build_local_pipeline(pair, disco_home(), measure_costs=True)
    dataset = load_dataset(args.dataset, limit=args.limit)
    prompts = [item.encode(pipeline.tokenizer) for item in dataset.items]
    base = pipeline.generator
    factories = {"calibrated": PolicyFactory(default_learned_loader(pipeline.draft)),
                 "raw": PolicyFactory(default_learned_loader(pipeline.draft), calibrate_acceptance=False)}
    generators = {label: SpeculativeGenerator(drafter=DraftEngine(pipeline.draft.model, factory),
                                              verifier=base.verifier, decode=base.decode,
                                              eos_token_ids=base.eos_token_ids, costs=base.costs)
                  for label, factory in factories.items()}
    started = time.perf_counter()
    rows = run(generators, prompts, args.max_new_tokens)
    calibration = factories["calibrated"].calibration("default")
    summary = calibration.summary()
    identical = sum(a == b for a, b in zip(rows["calibrated"].pop("outputs"), rows["raw"].pop("outputs")))
    report = {"dataset": dataset.name, "engines": {"target": pair.target.dtype, "draft": pair.draft.dtype},
              "max_new_tokens": args.max_new_tokens, "judged_tokens": summary["judged"],
              "ece_raw": round(summary["ece_raw"], 4), "ece_calibrated": round(summary["ece_calibrated"], 4),
              "identical": f"{identical}/{len(prompts)}", "runs": rows,
              "table": [{"predicted": round(mid, 3), "judged": judged, "observed": round(rate, 3)}
                        for mid, judged, rate in calibration.table()],
              "wall_s": round(time.perf_counter() - started, 1)}
    print(f"{dataset.name}: {summary['judged']} judged tokens; calibration error (ECE, 10 bins) "
          f"raw {summary['ece_raw']:.4f} -> calibrated {summary['ece_calibrated']:.4f}")
    print(f"{'run':<11} {'tok/s':>7} {'mean block':>10} {'acceptance':>10}")
    for label, row in rows.items():
        print(f"{label:<11} {row['tokens_per_s']:>7.2f} {row['mean_block']:>10.2f} {row['acceptance']:>10.3f}")
    print(f"identical outputs: {report['identical']}")
    print("predicted -> observed acceptance: " + ", ".join(
        f"{row['predicted']:.3f}->{row['observed']:.2f} ({row['judged']})" for row in report["table"]))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
