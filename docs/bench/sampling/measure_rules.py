"""Acceptance and tokens/s of ``auto`` (and ``none``) on the real pair under a sampling rule (issue 47).

Runs the local pipeline ``disco generate`` builds (default pair, ``--dtype auto`` engines,
measured costs for ``auto``) over HumanEval test prompts at each temperature (top_p 1.0),
the policies (``none,auto,heuristic:3`` by default: ``auto`` may draft nothing where the
measured costs say speculation cannot pay) interleaved per prompt, seed = prompt index. The rule is the code's:
run it with this checkout for drafter-invariant sampling, and with an export of the commit
before it on ``PYTHONPATH`` for rejection sampling::

    python docs/bench/sampling/measure_rules.py --label invariant --json-out invariant.json
    git archive 7d9bcff | tar -x -C /tmp/base   # the commit the change was made on
    PYTHONPATH=/tmp/base python docs/bench/sampling/measure_rules.py --label rejection --json-out rejection.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

import disco
from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig
from disco.engines.engine_choice import choose_engine
from disco.engines.in_process import build_local_pipeline
from disco.models.loading import disco_home
from disco.offline.datasets import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--policies", default="none,auto,heuristic:3")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    home = disco_home()
    pair = PairConfig(target=ModelConfig(dtype=choose_engine("auto", None, "target", "cpu", home)),
                      draft=ModelConfig(dtype=choose_engine("auto", None, "draft", "cpu", home)))
    pipeline = build_local_pipeline(pair, home, measure_costs=True)
    generator, tokenizer = pipeline.generator, pipeline.tokenizer
    prompts = [item.encode(tokenizer) for item in load_dataset("humaneval:test", args.limit).items]
    generator.generate(prompts[0], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0),
                       SpeculationConfig(policy="auto"))  # warm-up
    policies = args.policies.split(",")
    rows = []
    for temperature in [float(value) for value in args.temperatures.split(",")]:
        for index, ids in enumerate(prompts):
            for policy in policies:
                params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=index,
                                        ignore_eos=True)
                started = time.perf_counter()
                result = generator.generate(ids, params, SpeculationConfig(policy=policy))
                wall = time.perf_counter() - started
                stats = result.stats
                rows.append({"temperature": temperature, "prompt": index, "policy": policy,
                             "tokens": len(result.token_ids), "wall_s": round(wall, 4),
                             "tokens_per_s": round(len(result.token_ids) / wall, 4),
                             "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
                             "mean_lookahead": round(stats.mean_lookahead, 4), "token_ids": result.token_ids})
                print(json.dumps({key: value for key, value in rows[-1].items() if key != "token_ids"}), flush=True)
    summary = {}
    for temperature in sorted({row["temperature"] for row in rows}):
        for policy in policies:
            picked = [row for row in rows if row["temperature"] == temperature and row["policy"] == policy]
            tokens, wall = sum(row["tokens"] for row in picked), sum(row["wall_s"] for row in picked)
            drafted, accepted = sum(row["draft_tokens"] for row in picked), sum(row["accepted_tokens"] for row in picked)
            summary[f"{policy}@{temperature}"] = {"tokens_per_s": round(tokens / wall, 3),
                                                  "acceptance": round(accepted / drafted, 4) if drafted else None,
                                                  "draft_tokens": drafted}
        for policy in policies[1:]:
            same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(
                [row for row in rows if row["temperature"] == temperature and row["policy"] == policies[0]],
                [row for row in rows if row["temperature"] == temperature and row["policy"] == policy]))
            summary[f"{policy}_text_equal_to_{policies[0]}@{temperature}"] = f"{same}/{len(prompts)}"
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    out = {"label": args.label, "code": disco.__file__, "engines": pair.engine, "machine": model,
           "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "max_new_tokens": args.max_new_tokens, "prompts": f"humaneval:test[:{args.limit}]", "summary": summary,
           "rows": rows}
    with open(args.json_out, "w") as handle:
        json.dump(out, handle, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
